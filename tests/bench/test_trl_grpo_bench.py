"""bench/trl_grpo.py: hpcrl and TRL's GRPOTrainer from the same model (slow; needs TRL, the bench extra)."""

import pytest

from tests.bench.conftest import assert_table


@pytest.mark.slow
def test_trl_bench_runs_both_trainers_and_prints_its_table(run_bench):
    pytest.importorskip("trl", reason="TRL is only for this benchmark: pip install trl==1.16.0")
    out = run_bench("trl_grpo")
    rows = assert_table(out, "trainer", "reached", "steps", "train s")
    assert [r[0] for r in rows] == ["hpcrl", "trl"]
    assert [r[2] for r in rows] == ["2", "2"]  # --quick: 2 steps each, far from the target
    assert "did not reach" in out
