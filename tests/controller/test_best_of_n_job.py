"""``python -m hpcrl.main experiment=mod10_best_of_n`` end to end: the best-of-N scaffold as the rollout workflow."""

import psutil
import pytest

from tests.controller.test_job import metrics_of, run_job, summary_of

OWN_VERIFIER = "hpcrl.reward.builtin:math_verify_reward"


def verifier_workers() -> list[psutil.Process]:
    """Live reward processes of the verifier (the job's task reward is mod10, so these are the verifier's)."""
    found = []
    for p in psutil.process_iter():
        try:
            if {"hpcrl.reward.worker", OWN_VERIFIER} <= set(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        [],  # the overlay: train on every candidate, the task reward as verifier
        ["workflow.train_on=chosen", f"workflow.verifier={OWN_VERIFIER}"],  # a verifier in reward processes of its own
    ],
    ids=["all-candidates", "chosen-own-verifier"],
)
def test_a_best_of_n_job_trains_and_reports_like_the_default_job(tmp_path, overrides):
    common = ["experiment=mod10_best_of_n", "run.trial=bon", "run.max_steps=3", "eval.stop_at_accuracy=0"]
    summary = summary_of(run_job(tmp_path, *common, "rollout.prompts_per_step=16", *overrides))
    assert set(summary) >= {"steps", "wall_s", "eval_accuracy_before", "eval_accuracy_after", "run_dir"}
    assert summary["steps"] == 3
    run_dir = tmp_path / "mod10_best_of_n" / "bon"
    assert summary["run_dir"] == str(run_dir)
    rows = metrics_of(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("reward_mean" in r and "loss" in r for r in rows), rows[0]
    assert not verifier_workers(), "the verifier's reward processes end with the job"
