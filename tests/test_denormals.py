"""Subnormal floats are flushed to zero in the processes that compute: after ``flush_denormals`` (a trainer rank)
and the CPU server's ``set_torch_threads``, a subnormal input computes as zero in the calling thread and in a
thread started after it (the RPC handlers, the server's executor); without either it stays subnormal. Each case
runs in a process of its own: the mode is the process's, not the test's."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import threading, torch
{setup}
value = lambda: float(torch.tensor([1e-39]) * 2.0)  # 2e-39: subnormal in float32
seen = []
thread = threading.Thread(target=lambda: seen.append(value()))
thread.start(); thread.join()
print(value(), seen[0])
"""


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("", "2e-39 2e-39"),
        ("from hpcrl.denormals import flush_denormals; assert flush_denormals()", "0.0 0.0"),
        ("from hpcrl.inference.server.__main__ import set_torch_threads; set_torch_threads(1)", "0.0 0.0"),
    ],
    ids=["untouched", "trainer", "cpu-server"],
)
def test_subnormals_compute_as_zero_in_the_process_and_its_later_threads(setup, expected):
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], capture_output=True, text=True, check=True)
    got = " ".join(f"{float(v):.3g}" if float(v) else "0.0" for v in out.stdout.split())
    assert got == expected, out.stdout
