"""The multi-turn experiment end to end: ``python -m hpcrl.main experiment=mod10_multi_turn``, with PPO's critic
(GRPO runs multi-turn trajectories in test_job.py's staleness test)."""

import pytest

from tests.controller.test_job import metrics_of, run_job, summary_of


@pytest.mark.slow
def test_the_multi_turn_experiment_runs_end_to_end(tmp_path):
    overrides = ["experiment=mod10_multi_turn", "run.trial=mt", "run.max_steps=3", "rollout.prompts_per_step=16"]
    summary = summary_of(run_job(tmp_path, *overrides, "algorithm=ppo"))
    assert set(summary) == {
        "steps", "wall_s", "eval_accuracy_before", "eval_accuracy_after", "startup_s", "run_dir", "final_model",
        "final_critic",
    }  # fmt: skip
    run_dir = tmp_path / "mod10_multi_turn" / "mt"
    assert summary["steps"] == 3 and summary["run_dir"] == str(run_dir)
    rows = metrics_of(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # an untrained model is mostly wrong, so most trajectories go on past one turn of 2 tokens
    assert all(r["completion_len_mean"] > 2 * 2 for r in rows), rows
    # the critic's values of every turn's tokens (those between turns are not steps) gave each its return
    assert all("critic_loss" in r and "return_mean" in r and "critic_explained_var" in r for r in rows), rows
