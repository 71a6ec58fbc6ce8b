"""bench/staleness.py: each cell's overrides, steps and wall time to the target, medians over seeds (by hand values,
no job runs)."""

from pathlib import Path

import pytest
from _jobs import JobResult
from staleness import Outcome, cell_overrides, cell_row, censored_median, mean_masked, outcome, seed_row, to_target

METRICS = [
    {"step": 1, "time_step_s": 0.5},
    {"step": 2, "time_step_s": 0.25},
    {"step": 3, "time_step_s": 1.0, "eval_accuracy": 0.5},
    {"step": 4, "time_step_s": 0.125},
    {"step": 5, "time_step_s": 2.0, "eval_accuracy": 0.9},
    {"step": 6, "time_step_s": 4.0, "eval_accuracy": 0.95},
]


def test_each_cell_sets_the_staleness_the_task_and_the_correction_by_their_setting_names():
    assert cell_overrides("default", 0, "none") == ["rollout.max_staleness=0"]
    assert cell_overrides("default", 2, "decoupled") == ["rollout.max_staleness=2", "algorithm.behavior_weight_cap=5"]
    assert cell_overrides("multi_turn", 4, "icepop") == [
        "experiment=mod10_multi_turn",
        "rollout.max_staleness=4",
        "algorithm.off_policy.kind=icepop",
    ]
    for kind in ("tis", "mis_token", "mis_sequence"):
        assert cell_overrides("default", 1, kind)[-1] == f"algorithm.off_policy.kind={kind}"
    with pytest.raises(ValueError, match="correction 'is'"):
        cell_overrides("default", 1, "is")
    with pytest.raises(ValueError, match="task 'gsm8k'"):
        cell_overrides("gsm8k", 1, "none")


def test_the_wall_time_to_the_target_sums_the_step_times_through_its_first_evaluation_at_it():
    assert to_target(METRICS, 0.9) == (5, 0.5 + 0.25 + 1.0 + 0.125 + 2.0)
    assert to_target(METRICS, 0.95) == (6, 7.875)
    assert to_target(METRICS, 0.5) == (3, 1.75)
    assert to_target(METRICS, 0.96) == (None, None)


def test_an_outcome_reads_the_jobs_metrics_and_final_accuracy():
    job = JobResult(Path("run"), 30.0, {"eval_accuracy_after": 0.9}, METRICS[:5])
    assert outcome(job, 0.9) == Outcome(5, 3.875, 0.9, 5, ())
    masked = [{**m, "off_policy_masked_frac": f} for m, f in zip(METRICS[:3], (0.25, 0.0, 0.125), strict=True)]
    assert outcome(JobResult(Path("run"), 30.0, None, [*masked, *METRICS[3:5]]), 0.9).masked_fracs == (0.25, 0.0, 0.125)
    stopped = JobResult(Path("run"), 30.0, None, METRICS[:4])
    assert outcome(stopped, 0.9).step is None and outcome(stopped, 0.9).steps_run == 4


def test_a_seed_that_missed_the_target_counts_as_beyond_the_budget_in_the_median():
    assert censored_median([30, None, 10]) == 30  # not 20, the median of the two that reached it
    assert censored_median([30, None, None]) is None
    assert censored_median([40, 10, 20, None]) == 30
    assert censored_median([10, 20, None, None]) is None
    assert censored_median([]) is None


def test_a_cells_summary_counts_the_seeds_at_the_target():
    outcomes = [Outcome(15, 6.0, 0.91, 15), Outcome(None, None, 0.85, 200), Outcome(25, 9.5, 0.9, 25)]
    assert cell_row(("default", 2, "tis"), outcomes) == ["default", 2, "tis", "2/3", 25, 9.5, "-"]
    assert cell_row(("default", 2, "tis"), outcomes[1:2]) == ["default", 2, "tis", "0/1", "-", "-", "-"]


def test_the_masked_fraction_is_the_mean_over_the_steps_run_and_a_dash_where_it_is_absent():
    a = Outcome(15, 6.0, 0.91, 3, (0.5, 0.25, 0.0))
    b = Outcome(None, None, 0.85, 1, (0.125,))
    assert mean_masked([a]) == 0.25 and mean_masked([a, b]) == pytest.approx(0.875 / 4), "over steps, not seeds"
    assert mean_masked([Outcome(5, 1.0, 0.9, 5)]) is None
    assert cell_row(("default", 1, "mis_token"), [a, b])[-1] == pytest.approx(0.21875)
    assert seed_row(("default", 1, "mis_token"), 0, a) == ["default", 1, "mis_token", 0, 15, 6.0, 0.91, 3, 0.25]
    assert seed_row(("default", 1, "none"), 1, Outcome(None, None, 0.5, 200))[-1] == "-"
