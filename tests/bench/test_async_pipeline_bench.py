"""bench/async_pipeline.py: the pipeline bound from the sync job's timings, and the real jobs (slow)."""

from pathlib import Path

import pytest
from _jobs import JobResult
from async_pipeline import stages

from tests.bench.conftest import assert_table


def _job(steps: list[tuple[float, float, float]]) -> JobResult:
    metrics = [
        {"time_rollout_wait_s": g, "time_train_s": t, "time_sync_s": s, "time_step_s": g + t + s} for g, t, s in steps
    ]
    return JobResult(Path("."), 0.0, {}, metrics)


def test_the_bound_takes_the_longer_stage_of_each_step():
    sequential, bound, gen_share = stages(_job([(2.0, 0.5, 0.5), (0.5, 1.0, 0.5)]))
    assert sequential == pytest.approx(5.0)
    assert bound == pytest.approx(2.0 + 1.5)  # max(2, 1) + max(0.5, 1.5): sync belongs to the training stage
    assert gen_share == pytest.approx(2.5 / 5.0)


@pytest.mark.slow
def test_async_pipeline_bench_runs_its_jobs_and_prints_its_table(run_bench):
    out = run_bench("async_pipeline", "--staleness", "0", "1")  # two jobs of the three it runs by default
    rows = assert_table(out, "job", "steps s", "/ pipeline bound")
    assert [r[0] for r in rows[:2]] == ["max_staleness=0", "max_staleness=1"]
    assert rows[0][3] == "1"  # sync / sync
    assert "/ pipeline bound =" in out
