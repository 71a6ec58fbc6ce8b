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


def test_the_cpu_bound_spreads_hpcrls_cpu_seconds_over_the_cores_against_trls_step(monkeypatch):
    import os

    from trl_grpo import cpu_bound, trl_cpu_s_per_step

    log = [(1, 0.1, 10.0, 3.0), (2, 0.2, 10.5, 3.9), (4, 0.8, 11.5, 5.5)]  # (step, reward, time, CPU s)
    assert trl_cpu_s_per_step(log, log[1]) == pytest.approx(0.9) and trl_cpu_s_per_step(log, None) == pytest.approx(
        2.5 / 3
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    runs = {"hpcrl": [{"cpu_step": 0.6}], "trl": [{"train_s": 4.0, "steps": 10}]}
    line = cpu_bound(runs)
    assert "0.600 CPU s a step over 2 cores = 0.300 s" in line and "0.400 s / that = 1.33" in line
