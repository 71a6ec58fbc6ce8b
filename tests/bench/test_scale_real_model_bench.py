"""bench/scale_real_model.py: the whole loop with a chat model of a given shape (tiny here), each process's peak
memory and the steps' times."""

import json

from tests.bench.conftest import assert_table


def test_scale_bench_prints_peak_memory_by_process_and_step_times(run_bench):
    out = run_bench("scale_real_model")
    memory = {row[0]: float(row[2]) for row in assert_table(out, "process", "count", "peak GiB")}
    assert {"controller", "inference server", "trainer rank 0", "trainer rank 1"} <= set(memory), out
    assert all(0 < gib < 8 for gib in memory.values()), memory
    steps = assert_table(out, "step", "rollout wait", "train", "weight sync")
    assert [row[0] for row in steps] == ["1", "2"]
    assert all(float(row[1]) >= float(row[3]) for row in steps), "a step holds its training"
    summary = json.loads(out.split("summary: ", 1)[1].splitlines()[0])
    assert summary["steps"] == 2 and summary["final_model"].endswith("/final")
