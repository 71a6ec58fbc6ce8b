"""The tiny job with ``train.weight_sync=distributed`` against CPU servers that hold SGLang 0.5.23's contract.

Every push is a session (begin, one call per bucket, end) to servers whose tensor-parallel ranks are all
members of the group (``rank_offset + tp_rank``); trainer rank 0 hosts the group's rendezvous on its own
node with a port of its own slice. The runs must learn, not only finish: a push that left the servers on
stale or garbled weights would keep held-out accuracy where it started.
"""

import json
import re

import pytest

from tests.controller.test_job import metrics_of, processes_of, run_job, summary_of

STEPS = 40


@pytest.mark.slow
@pytest.mark.parametrize(
    ("allocation", "extra", "server_ranks", "dtype"),
    [
        ("cpu:d1t2+fsdp:d2g0", [], 2, "float32"),
        # two servers of two ranks (a group of 5), in bf16 (the trainers on CPU compute in fp32), 1 MiB calls
        ("cpu:d2t2+fsdp:d2g0", ["model.dtype=bfloat16", "train.weight_sync_bucket_mb=1"], 4, "bfloat16"),
    ],
    ids=["one-server-tp2", "two-servers-tp2-bf16"],
)
def test_distributed_weight_sync_learns_the_task(tmp_path, allocation, extra, server_ranks, dtype):
    trial = f"dist-{server_ranks}"
    overrides = [f"run.trial={trial}", f"run.max_steps={STEPS}", f"allocation={allocation}", *extra]
    result = run_job(tmp_path, *overrides, "train.weight_sync=distributed", "eval.stop_at_accuracy=0")
    summary = summary_of(result)
    assert summary["steps"] == STEPS
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.3, summary
    formed = re.search(
        r"weight-update group formed at trainer rank 0's (\S+):(\d+) \((\w+)\) with (\d+) server ranks; "
        r"a push is (\d+) call\(s\) of at most \d+ MB \((\w+), ([\d.]+) MB in all\)",
        result.stderr,
    )
    assert formed, result.stderr[-3000:]
    host, _, backend, ranks, calls, wire, _ = formed.groups()
    assert (backend, int(ranks), wire) == ("gloo", server_ranks, dtype)
    trainer0 = json.loads((tmp_path / "default" / trial / "registry" / "trainer-0.json").read_text())
    assert host == trainer0["host"], "the rendezvous is on trainer rank 0's own address"
    if dtype == "bfloat16":
        assert int(calls) > 1, "1 MiB buckets of the tiny model in bf16 take more than one call"
    rows = metrics_of(tmp_path / "default" / trial)
    assert rows[-1]["token_version_min"] == STEPS - 1, "the last step sampled with the weights of the one before"
    assert not processes_of(str(tmp_path / "default" / trial)), "no process of the run outlives it"
