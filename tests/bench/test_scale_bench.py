"""bench/scale.py: hpcrl and TRL's GRPOTrainer as the model and the prompts grow (slow; needs TRL)."""

import pytest

from tests.bench.conftest import assert_table


@pytest.mark.slow
def test_scale_bench_runs_both_sweeps_and_prints_their_tables(run_bench, tmp_path):
    pytest.importorskip("trl", reason="TRL is only for the benchmarks: pip install trl==1.16.0")
    plot = tmp_path / "scale.png"
    out = run_bench("scale", "--plot", str(plot), timeout=900)
    rows = assert_table(out, "model", "params", "hpcrl s/step", "TRL s/step", "TRL / hpcrl")
    assert [r[0] for r in rows[:2]] == ["0.5M", "4M"], rows  # --quick: the two smallest models at 8 prompts
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    assert abs(float(rows[0][5]) - float(rows[0][4]) / float(rows[0][3])) < 0.03 * float(rows[0][5]) + 1e-3
    assert out.count("hpcrl's step is at least as fast as TRL's") == 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
