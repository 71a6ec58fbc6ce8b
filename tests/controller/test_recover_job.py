"""Recovery end to end: a run killed with SIGKILL and rerun with ``recover.mode=auto`` goes on from its newest
complete checkpoint, to its step budget, every step logged once."""

import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from tests.conftest import REPO
from tests.controller.test_job import metrics_of, processes_of, run_job, summary_of

# a step of 8 prompts takes 0.1-0.2 s here, so a kill up to 1 s after its step may land up to ~8 steps later: the
# budget leaves room for such kills and the rerun to go on past them
MAX_STEPS, EVERY = 40, 2
SMALL = [f"checkpoint.every_steps={EVERY}", "recover.mode=auto", "eval.stop_at_accuracy=0", "eval.every_steps=0"]
SMALL += ["rollout.prompts_per_step=8"]
KILLS = 2  # SIGKILLs at random moments, each rerun resuming; then one Ctrl-C and the printed command


def steps_logged(run_dir) -> list[int]:
    """The steps in metrics.jsonl; a line the writer has not finished yet is not counted."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def newest_complete_checkpoint(run_dir) -> int:
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if (p / "controller.json").is_file()]
    return max(steps, default=0)


def kill_run(job: subprocess.Popen, run_dir) -> None:
    """SIGKILL the controller and every process of the run: its children (the workers start in sessions of
    their own, so the controller's process group does not hold them) and whatever names the run directory."""
    victims = processes_of(str(run_dir))
    if job.poll() is None:
        victims += psutil.Process(job.pid).children(recursive=True)
        os.killpg(job.pid, signal.SIGKILL)
    for p in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    job.wait(timeout=30)
    _, alive = psutil.wait_procs(victims, timeout=30)
    assert not alive, f"processes outlived SIGKILL: {alive}"


def run_until_killed(tmp_path, trial: str, kill_after: int, delay_s: float | None, log) -> str:
    """Start the run; once step ``kill_after`` is logged, wait ``delay_s`` (kills land in a step or in a
    checkpoint), or with None until the trainers write a checkpoint, and kill it. Returns its stderr."""
    run_dir = tmp_path / "default" / trial
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", f"run.trial={trial}", *SMALL]
    cmd += [f"run.max_steps={MAX_STEPS}"]
    with log.open("w") as err:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            wait_until(lambda: kill_after in steps_logged(run_dir), job, log, f"step {kill_after}")
            if delay_s is None:
                writing = lambda: any((run_dir / "checkpoints").glob("*.partial"))  # noqa: E731
                wait_until(writing, job, log, "a checkpoint being written", poll_s=0.005)
            else:
                time.sleep(delay_s)
        finally:
            kill_run(job, run_dir)
    return log.read_text()


def ctrl_c_after_a_step(tmp_path, trial: str, log) -> str:
    """Start the run, SIGINT its process group (a terminal's Ctrl-C) once it logged a step of its own, and return the
    command it prints to resume, after checking it says it was interrupted, exits 130 and leaves no process."""
    run_dir = tmp_path / "default" / trial
    before = len(steps_logged(run_dir))
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", f"run.trial={trial}", *SMALL]
    cmd += [f"run.max_steps={MAX_STEPS}"]
    with log.open("w") as err:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            wait_until(lambda: len(steps_logged(run_dir)) > before, job, log, "a step")
            os.killpg(job.pid, signal.SIGINT)
            code = job.wait(timeout=60)
        finally:
            kill_run(job, run_dir)
    stderr = log.read_text()
    assert code == 130, stderr[-3000:]
    assert f"hpcrl: the run in {run_dir} was interrupted (Ctrl-C) and every worker is stopped" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not processes_of(str(run_dir)), "no process of the run outlives the interruption"
    return stderr.strip().splitlines()[-1].strip()


def wait_until(condition, job: subprocess.Popen, log, what: str, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + 300
    while not condition():
        assert job.poll() is None, f"the run ended before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the run did not reach {what}"
        time.sleep(poll_s)


def resumed_step(stderr: str) -> int:
    """The step the run resumed from, 0 when it started fresh (from the controller's log)."""
    if "no complete checkpoint" in stderr:
        return 0
    found = re.search(r"resumed at step (\d+)", stderr)
    assert found, f"the rerun said neither that it resumed nor that it started fresh:\n{stderr[-3000:]}"
    return int(found.group(1))


@pytest.mark.slow
def test_a_run_killed_at_random_steps_resumes_to_its_budget(tmp_path):
    # a new seed each run (printed; HPCRL_KILL_SEED=N repeats one). Seed 58339 once lost step 4's line (its
    # checkpoint was complete before the line was written); it ran here as a fixed case too until the suite's time
    # was needed elsewhere: test_a_run_killed_the_moment_a_checkpoint_is_complete_keeps_that_steps_line aims at
    # exactly that moment, and HPCRL_KILL_SEED=58339 replays it
    seed = int(os.environ.get("HPCRL_KILL_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    trial, run_dir = "killed", tmp_path / "default" / "killed"
    expected_start, logged = 0, 0  # the step the next attempt resumes from; the last step logged before the kill
    for attempt in range(KILLS):
        kill_after = logged + rng.randint(1, 2)  # past anything the killed attempt logged: this attempt's own step
        delay_s = None if rng.random() < 0.5 else round(rng.uniform(0, 1.0), 2)
        moment = "while a checkpoint is written" if delay_s is None else f"{delay_s} s"
        print(f"seed {seed} (HPCRL_KILL_SEED): attempt {attempt} killed {moment} after step {kill_after}")
        stderr = run_until_killed(tmp_path, trial, kill_after, delay_s, tmp_path / f"attempt{attempt}.err")
        assert resumed_step(stderr) == expected_start
        steps = steps_logged(run_dir)
        assert steps == list(range(1, len(steps) + 1)), f"a step repeated or skipped in metrics.jsonl: {steps}"
        logged, expected_start = steps[-1], newest_complete_checkpoint(run_dir)
        # a kill after step N's line and before N's checkpoint is marked complete loses N's whole interval: EVERY
        # steps (CI's seed 56332 landed there); a skipped complete checkpoint would lose more
        assert logged - expected_start <= EVERY, "the kill lost more steps than one checkpoint interval"

    # one more attempt is interrupted as a terminal's Ctrl-C does it; the command it prints resumes the run to the end
    command = ctrl_c_after_a_step(tmp_path, trial, tmp_path / "interrupted.err")
    expected_start = newest_complete_checkpoint(run_dir)
    assert "recover.mode=auto" in command and f"run.trial={trial}" in command, command
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "hpcrl.main"], command
    result = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600)
    summary = summary_of(result)
    assert summary["steps"] == MAX_STEPS
    assert summary["resumed_from_step"] == expected_start
    rows = metrics_of(run_dir)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    # the servers got the checkpoint's weights before the first rollout: synchronous rollout goes on exactly
    assert all(r["token_version_min"] == r["step"] - 1 and r["staleness_max"] == 0 for r in rows), rows
    assert not processes_of(str(run_dir)), "no process of the run outlives it"


@pytest.mark.slow
def test_an_interrupted_checkpoint_is_skipped_for_the_one_before(tmp_path):
    # with PPO's critic, whose part of each checkpoint (critic/) resumes with the trainers'
    trial, run_dir = "torn", tmp_path / "default" / "torn"
    ppo = ["algorithm=ppo", *SMALL]
    assert summary_of(run_job(tmp_path, f"run.trial={trial}", "run.max_steps=4", *ppo))["steps"] == 4
    first = {r["step"]: r for r in metrics_of(run_dir)}
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "step_000002" / "critic" / "trainer_state.json").is_file()
    (checkpoints / "step_000004" / "controller.json").unlink()  # killed after the trainers' part, before the marker
    shutil.copytree(checkpoints / "step_000004", checkpoints / "step_000006.partial")  # killed while trainers wrote

    summary = summary_of(run_job(tmp_path, f"run.trial={trial}", *ppo, "run.max_steps=6"))
    assert (summary["steps"], summary["resumed_from_step"]) == (6, 2)
    assert [r["step"] for r in metrics_of(run_dir)] == [1, 2, 3, 4, 5, 6]
    # steps 3 and 4 again, from step 2's policy and critic: synchronous seeded rollout repeats them, and the
    # critic's values with them (a fresh critic's would be 0 at step 3)
    again = {r["step"]: r for r in metrics_of(run_dir)}
    for step in (3, 4):
        assert again[step]["reward_mean"] == first[step]["reward_mean"]
        assert first[step]["critic_value_mean"] != 0.0
        assert again[step]["critic_value_mean"] == pytest.approx(first[step]["critic_value_mean"], abs=1e-4)
    # checkpoint.keep=2: once step 6 is complete, step 2 goes
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000004", "step_000006"]
    assert (checkpoints / "latest").read_text() == "step_000006\n"


@pytest.mark.slow
def test_a_run_killed_the_moment_a_checkpoint_is_complete_keeps_that_steps_line(tmp_path):
    # the controller is killed as soon as step 4's controller.json appears (polled every 0.5 ms, SIGKILL to it
    # at once): before the fix the step's metrics line came after it, and the resumed run, which keeps the
    # lines up to the checkpoint's step, went on at step 5 without one for step 4
    trial, run_dir = "at-publish", tmp_path / "default" / "at-publish"
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", f"run.trial={trial}", *SMALL, "run.max_steps=8"]
    marker = run_dir / "checkpoints" / "step_000004" / "controller.json"
    log = tmp_path / "attempt.err"
    with log.open("w") as err:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            wait_until(marker.exists, job, log, "step 4's checkpoint", poll_s=0.0005)
            os.killpg(job.pid, signal.SIGKILL)  # the controller leads its session: nothing more of it runs
        finally:
            kill_run(job, run_dir)
    assert 4 in steps_logged(run_dir), "a complete checkpoint of step 4, and no line for step 4"
    # resumed with a new budget and learning rate, which apply (the checkpoint's optimizer state held the old lr)
    result = run_job(tmp_path, f"run.trial={trial}", *SMALL, "run.max_steps=6", "train.lr=0.001")
    summary = summary_of(result)
    assert (summary["steps"], summary["resumed_from_step"]) == (6, 4)
    rows = metrics_of(run_dir)
    assert [(r["step"], r["lr"]) for r in rows] == [(1, 5e-4), (2, 5e-4), (3, 5e-4), (4, 5e-4), (5, 1e-3), (6, 1e-3)]
    changes = "run.max_steps: 8 -> 6; train.lr: 0.0005 -> 0.001"
    assert f"with changed settings (config.resumed-1.yaml, beside config.yaml): {changes}" in result.stderr
    # config.yaml stays what the run started with; the config it went on with, which the workers read, is beside it
    first = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (first["run"]["max_steps"], first["train"]["lr"]) == (8, 5e-4)
    resumed = (run_dir / "config.resumed-1.yaml").read_text()
    head = ["# resumed with these changes from config.yaml:", "# run.max_steps: 8 -> 6", "# train.lr: 0.0005 -> 0.001"]
    assert resumed.splitlines()[:3] == head
    assert (yaml.safe_load(resumed)["run"]["max_steps"], yaml.safe_load(resumed)["train"]["lr"]) == (6, 1e-3)


@pytest.mark.slow
def test_a_newest_checkpoint_with_its_tensors_cut_short_resumes_from_the_one_before(tmp_path):
    # every damage a checkpoint can have, and none usable (a fresh start), are tests/controller/test_recovery.py's
    trial, run_dir = "cut", tmp_path / "default" / "cut"
    assert summary_of(run_job(tmp_path, f"run.trial={trial}", "run.max_steps=4", *SMALL))["steps"] == 4
    checkpoints = run_dir / "checkpoints"
    tensors = max((checkpoints / "step_000004").glob("*.distcp"), key=lambda p: p.stat().st_size)
    tensors.write_bytes(tensors.read_bytes()[:1000])  # a node crash before the data reached the disk

    result = run_job(tmp_path, f"run.trial={trial}", *SMALL, "run.max_steps=6")
    summary = summary_of(result)
    assert (summary["steps"], summary["resumed_from_step"]) == (6, 2)
    assert (
        f"checkpoint step_000004 cannot be resumed from: the tensor file {tensors.name} is cut short" in result.stderr
    )
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, 7))
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["latest", "step_000004", "step_000004.broken", "step_000006"]


@pytest.mark.slow
def test_elastic_resume_of_a_lora_run_with_dropout_goes_on_as_the_uninterrupted_one(tmp_path):
    """The adapter and its optimizer state are all a LoRA checkpoint holds: resumed at step 3 (its adapter loaded
    into the trainers and pushed to the servers first), steps 4-5 sample the same rewards and train the same loss
    as the run that never stopped. With dropout too: the trainers seed each update's draws, which a new process would
    otherwise start over. The resumed run is a copy of the whole one with its checkpoints after step 3 gone."""
    lora = ["train.lora.rank=8", "train.lora.dropout=0.1", "train.lr=1e-3", "checkpoint.every_steps=3"]
    lora += ["eval.every_steps=0", "eval.stop_at_accuracy=0", "rollout.prompts_per_step=8", "recover.mode=auto"]
    whole = summary_of(run_job(tmp_path, "run.trial=whole", "run.max_steps=5", *lora))
    runs = tmp_path / "default"
    shutil.copytree(runs / "whole", runs / "cut")
    for later in (runs / "cut" / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > 3:
            shutil.rmtree(later)
    resumed = run_job(tmp_path, "run.trial=cut", "run.max_steps=5", *lora)
    assert summary_of(resumed)["resumed_from_step"] == 3 and whole["steps"] == 5
    keys = ("reward_mean", "loss", "grad_norm", "token_version_min")
    rows = {trial: metrics_of(runs / trial) for trial in ("whole", "cut")}
    assert [r["step"] for r in rows["cut"]] == list(range(1, 6))
    assert [[r[k] for k in keys] for r in rows["cut"][3:]] == [[r[k] for k in keys] for r in rows["whole"][3:]]
    assert (
        json.loads((runs / "cut" / "checkpoints" / "step_000003" / "trainer_state.json").read_text())["lora"]["rank"]
        == 8
    )
