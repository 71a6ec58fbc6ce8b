"""bench/train_step.py: one update of the engine, unsharded and under FSDP2, against plain PyTorch."""

from tests.bench.conftest import assert_table


def test_train_step_bench_prints_each_way_against_plain(run_bench):
    out = run_bench("train_step")
    rows = assert_table(out, "way", "ms per update", "/ plain")
    assert [r[0] for r in rows] == ["engine", "engine, FSDP2", "plain"]
    assert all(float(r[1]) > 0 for r in rows) and float(rows[2][2]) == 1
    assert "engine, FSDP2 / engine: " in out
