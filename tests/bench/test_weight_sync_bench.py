"""bench/weight_sync.py: disk (weights alone, and as save_pretrained writes them) and gloo between two processes,
against memcpy and raw disk."""

from tests.bench.conftest import assert_table


def test_weight_sync_bench_prints_every_way_for_each_model(run_bench):
    out = run_bench("weight_sync")
    rows = assert_table(out, "model", "way", "ms", "GB/s")
    ways = ["disk", "disk: export", "disk, save_pretrained", "gloo", "memcpy", "raw disk"]
    assert [r[1] for r in rows] == ways * 2
    assert rows[0][0].startswith("tiny (0.5M params") and rows[len(ways)][0].startswith("quick (2.1M params")
    assert all(float(r[2]) > 0 for r in rows)
    assert "gloo / disk time" in out
