"""The benchmark scripts run as a user runs them; their helpers are imported from ``bench/`` directly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

BENCH = REPO / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # last, so that no script shadows an installed module of the same name


@pytest.fixture
def run_bench():
    """``run_bench(name, *args) -> stdout`` of ``python bench/<name>.py --quick ARGS``; fails with its output."""

    def run(name: str, *args: str, timeout: float = 400) -> str:
        cmd = [sys.executable, str(BENCH / f"{name}.py"), "--quick", *args]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-3000:]}"
        return result.stdout

    return run


def assert_table(out: str, *header: str) -> list[list[str]]:
    """The Markdown table in ``out`` whose header holds ``header``; its rows as lists of cells."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if all(h in line for h in header)), None)
    assert start is not None, f"no table with {header} in:\n{out}"
    assert lines[start + 1].startswith("|--"), out
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    assert rows, f"the table with {header} has no rows:\n{out}"
    return rows
