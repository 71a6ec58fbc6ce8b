"""bench/algorithms.py: steps to a held-out accuracy per algorithm and seed (a real PPO job, 2 steps)."""

import pytest
from algorithms import reached

from tests.bench.conftest import assert_table


def test_reached_is_the_first_evaluation_at_the_target():
    class Job:
        metrics = [{"step": 5, "eval_accuracy": 0.5}, {"step": 6}, {"step": 10, "eval_accuracy": 0.9}]

    assert reached(Job(), 0.9) == 10 and reached(Job(), 0.95) is None


@pytest.mark.slow
def test_algorithms_bench_runs_ppo_and_reports_its_critics_explained_variance(run_bench):
    out = run_bench("algorithms", "--seeds", "0", "--algorithms", "ppo")
    (row,) = assert_table(out, "algorithm", "seed", "step at 0.9", "samples", "EV first 10")
    assert row[:2] == ["ppo", "0"] and row[4] == "2"
    assert int(row[5]) == 2 * 8 * 8, "2 steps of 8 prompts (--quick) x group size 8"
    assert row[6] != "nan", "the critic's explained variance is reported"
