"""Resuming on another allocation end to end: a checkpoint written by N trainer ranks goes on with M (the trainers'
state is resharded by DCP), with another number of servers too, and trains the same step."""

import shutil

import pytest

from tests.controller.test_job import metrics_of, run_job, summary_of

SMALL = ["checkpoint.every_steps=1", "checkpoint.keep=0", "recover.mode=auto", "eval.stop_at_accuracy=0"]
# synchronous (rollout.max_staleness=0) with run.seed=0: a step's rollouts are the same on any allocation
SMALL += ["eval.every_steps=0", "rollout.prompts_per_step=8"]


def trained(tmp_path, trial: str, steps: int, trainers: int, *more: str) -> dict[int, dict]:
    """Run (or resume) ``trial`` to ``steps`` on ``trainers`` ranks; its metrics by step."""
    overrides = [f"run.trial={trial}", f"run.max_steps={steps}", f"allocation.trainer.workers={trainers}", *more]
    assert summary_of(run_job(tmp_path, *overrides, *SMALL))["steps"] == steps
    return {r["step"]: r for r in metrics_of(tmp_path / "default" / trial)}


def resumable_copy(tmp_path, trial: str, copy: str, step: int) -> None:
    """``trial``'s run directory as ``copy``, its checkpoints after ``step`` gone: a resume goes on from ``step``."""
    shutil.copytree(tmp_path / "default" / trial, tmp_path / "default" / copy)
    for later in (tmp_path / "default" / copy / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)


def loaded(tmp_path, trial: str, step: int) -> str:
    """What rank 0 of ``trial``'s trainers said when it loaded the checkpoint of run step ``step``."""
    lines = (tmp_path / "default" / trial / "logs" / "trainer-0.log").read_text().splitlines()
    found = [line for line in lines if f"checkpoints/step_{step:06d} (saved by" in line]
    assert found, f"{trial}'s trainers loaded no checkpoint of step {step}"
    return found[-1].split(" (", 1)[1]


def same_step(a: dict, b: dict) -> None:
    """The same rollouts (rewards) trained from the same weights and optimizer state: the loss agrees to 1e-5, and
    so does the gradient norm. The step's second optimizer update moves from Adam's moments, which the checkpoint
    holds."""
    assert a["reward_mean"] == b["reward_mean"] and a["token_version_min"] == b["token_version_min"]
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5, rel=0)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-5, rel=0)


@pytest.mark.slow
def test_elastic_resume_on_fewer_and_more_trainer_ranks_trains_the_same_step(tmp_path):
    # 2 -> 1: step 3 of a run on 2 ranks (what a resume on 2 ranks from step 2 trains: its lora and recovery tests
    # show a resume on the same allocation repeats the run exactly) and the resume from step 2 on 1 rank, 2 servers
    base = trained(tmp_path, "base", 3, 2)
    resumable_copy(tmp_path, "base", "shrunk", 2)
    shrunk = trained(tmp_path, "shrunk", 4, 1, "allocation.server.workers=2")  # on to step 4: the reference below
    assert loaded(tmp_path, "shrunk", 2) == "saved by 2 rank(s), loaded on 1)"
    same_step(shrunk[3], base[3])
    assert shrunk[3]["loss"] != pytest.approx(base[2]["loss"], abs=1e-3)  # another step, another loss

    # 1 -> 2: from the 1-rank run's checkpoint of step 3, step 4 on 2 ranks against the 1-rank run's own step 4
    resumable_copy(tmp_path, "shrunk", "grown", 3)
    grown = trained(tmp_path, "grown", 4, 2)
    assert loaded(tmp_path, "grown", 3) == "saved by 1 rank(s), loaded on 2)"
    same_step(grown[4], shrunk[4])
