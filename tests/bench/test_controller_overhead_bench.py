"""bench/controller_overhead.py: the split of a step's time from a timeline, and a real job (slow)."""

import pytest
from controller_overhead import split_steps, union_within

from tests.bench.conftest import assert_table


def test_union_merges_overlaps_and_clips_to_the_window():
    assert union_within([(0, 2), (1, 3), (5, 7), (9, 12)], 1, 10) == [(1, 3), (5, 7), (9, 10)]
    assert union_within([(0, 1)], 2, 3) == []


def test_a_step_splits_into_generation_or_training_sync_and_controller():
    timeline = [
        ["step", 0.0, 10.0, 1],
        ["gen", 0.0, 4.0, None],
        ["gen", 1.0, 5.0, None],  # concurrent requests count once
        ["reward", 4.5, 6.0, None],  # 5..6 is the controller alone, in a reward call
        ["train", 6.5, 8.0, None],
        ["sync", 8.0, 9.5, None],
        ["gen", 11.0, 12.0, None],  # after the step: not counted
    ]
    split = split_steps(timeline)
    assert split["total"] == pytest.approx(10.0)
    assert split["gen_or_train"] == pytest.approx(5.0 + 1.5)
    assert split["sync_only"] == pytest.approx(1.5)
    assert split["controller"] == pytest.approx(2.0)  # 5..6.5 and 9.5..10
    assert split["reward"] == pytest.approx(1.0)


def test_the_loops_work_between_two_steps_counts_as_the_controllers():
    timeline = [
        ["step", 0.0, 4.0, 1],
        ["gen", 0.0, 3.0, None],
        ["step", 5.0, 8.0, 2],  # 4..5: the metrics line and the progress line of step 1, nothing in flight
        ["gen", 4.5, 7.0, None],  # sent before step 2 began: generation from 4.5
        ["train", 7.0, 8.0, None],
        ["gen", 9.0, 10.0, None],  # after the last step: not counted
    ]
    split = split_steps(timeline)
    assert split["total"] == pytest.approx(8.0)
    assert split["gen_or_train"] == pytest.approx(3.0 + 3.5)
    assert split["controller"] == pytest.approx(1.0 + 0.5)  # 3..4 and 4..4.5


@pytest.mark.slow
def test_controller_overhead_bench_times_a_real_job(run_bench):
    out = run_bench("controller_overhead")
    rows = assert_table(out, "job", "gen or train", "weight sync", "controller", "neither")
    assert rows[0][0] == "max_staleness=0"
    shares = [float(c) for c in rows[0][2:5]]
    assert sum(shares) == pytest.approx(1.0, abs=0.01)
    assert "neither generation nor training" in out
