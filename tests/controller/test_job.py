"""``python -m hpcrl.main`` end to end on this machine: real servers, torchrun trainers, RPC, HTTP."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO


def run_job(tmp_path, *overrides, timeout=600):
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def summary_of(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for_steps(proc, run_dir, steps: int, timeout_s: float = 300) -> None:
    """Wait until the running job ``proc`` has logged ``steps`` steps (mid-run); fail if it ends first."""
    deadline = time.monotonic() + timeout_s
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics_of(run_dir)) >= steps):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"fewer than {steps} training steps within {timeout_s} s"
        time.sleep(0.2)


def cosine_factor(update: int, warmup: int, total: int) -> float:
    """The learning rate of optimizer update ``update`` (from 0) over train.lr: linear warm-up, then a cosine that
    reaches 0 after update ``total``."""
    if update < warmup:
        return (update + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (update - warmup) / (total - warmup)))


def frozen_heaps(run_dir) -> dict[str, list[int]]:
    """Per log file of the run, the start-up objects each process froze (``hpcrl.gc_freeze``'s log line)."""
    found: dict[str, list[int]] = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        counts = re.findall(r": (\d+) start-up objects frozen", log.read_text())
        if counts:
            found[log.stem] = [int(c) for c in counts]
    return found


def torch_threads(run_dir) -> dict[str, int]:
    """Per trainer or critic rank's log file, the torch threads its ready line names (which also says that the
    rank flushes subnormal floats to zero: ``hpcrl/denormals.py``)."""
    found = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        threads = re.search(r"; (\d+) torch threads, subnormals flushed to zero\)", log.read_text())
        if threads:
            found[log.stem] = int(threads.group(1))
    return found


def processes_of(run_dir: str) -> list[psutil.Process]:
    """Live processes whose environment names this run directory (every worker the schedulers start)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("HPCRL_RUN_DIR") == run_dir and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("staleness", "algorithm", "trainers"), [(0, "grpo", 1), (1, "ppo", 2)])
def test_every_trained_token_is_within_the_staleness_bound(tmp_path, staleness, algorithm, trainers):
    # with a critic (ppo) the step waits on its values and its update too, yet the rollout goes on meanwhile:
    # staleness 1 is reached, so episodes ran while the critic and the trainers worked. grpo: the default job's one
    # unsharded rank; ppo: two FSDP2 trainer ranks and the critic's
    trial = f"stale{staleness}"
    overrides = [
        f"run.trial={trial}",
        "run.max_steps=6",
        f"rollout.max_staleness={staleness}",
        f"algorithm={algorithm}",
        f"allocation.trainer.workers={trainers}",
    ]
    overrides += ["eval.stop_at_accuracy=0", "eval.every_steps=0", "rollout.prompts_per_step=16"]
    overrides += ["train.lr_schedule=cosine", "train.warmup_steps=1", "train.lr=0.001", "metrics.samples_every_steps=3"]
    overrides += ["train.critic_lr=0.002"] if algorithm == "ppo" else []  # without a critic: refused, it does nothing
    result = run_job(tmp_path, *overrides)
    summary_of(result)
    # the local cluster's own settings are not Slurm's: no warning (before: two, each with a RoleResources dump)
    assert "ignore" not in result.stderr and "no effect" not in result.stderr, result.stderr[-3000:]
    # stderr is a pipe: no progress bar in it, neither the run's (tqdm frames, one more per step) nor a library's
    # ("Writing model shards" as the tiny model is made), but a progress line each step (a tenth of 6 steps)
    assert not re.search(r"\d+%\|.*\| *\d+/\d+ \[", result.stderr), result.stderr[-3000:]
    assert "progress: step 6 of 6 (100%)" in result.stderr, result.stderr[-3000:]
    rows = metrics_of(tmp_path / "default" / trial)
    assert len(rows) == 6
    # the schedule counts every update (2 a step): a step logs its two updates' mean rate; the cosine ends after the
    # run's last update, not half-way (before, steps 4-6 of this run learnt at a rate of 0)
    want = [0.001 * (cosine_factor(2 * s, 2, 12) + cosine_factor(2 * s + 1, 2, 12)) / 2 for s in range(6)]
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-5), [r["lr"] for r in rows]
    if algorithm == "ppo":
        assert [r["critic_lr"] for r in rows] == pytest.approx([2 * lr for lr in want], rel=1e-5)
    # every 3 steps the batch's first 4 prompts, each with its group's 8 completions and their 0/1 rewards
    samples = [json.loads(line) for line in (tmp_path / "default" / trial / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [3] * 4 + [6] * 4
    assert all(re.fullmatch(r"\d+\+\d+=", s["prompt"]) and len(s["completions"]) == 8 for s in samples), samples
    assert {c["reward"] for s in samples for c in s["completions"]} <= {0.0, 1.0}
    assert all("samples" not in r for r in rows)
    # staleness of a token = the trainer's version at the step - the version that sampled it
    assert max(r["staleness_max"] for r in rows) == staleness, rows
    if staleness == 0:
        assert all(r["staleness_mean"] == 0 and r["token_version_min"] == r["step"] - 1 for r in rows)
    # every process froze its start-up heap once, before the first step (a full collection of the controller's
    # ~450k objects paused its loop 0.15-0.3 s every few seconds); the critic is a process of its own (ppo)
    frozen = frozen_heaps(tmp_path / "default" / trial)
    ranks = {f"trainer-{r}" for r in range(trainers)} | ({"critic-0"} if algorithm == "ppo" else set())
    assert set(frozen) == {"controller-0", "server-proc-0"} | ranks, frozen
    assert all(len(counts) == 1 and counts[0] > 100_000 for counts in frozen.values()), frozen
    # the training ranks share this machine's cores as torch threads (roles.rank_threads): one rank takes them all
    # (2 on 2 cores, where a hard-coded 1 would fail), three ranks on 2 cores are left no fewer than one
    threads = torch_threads(tmp_path / "default" / trial)
    assert threads == {rank: max(1, len(os.sched_getaffinity(0)) // len(ranks)) for rank in ranks}, threads


@pytest.mark.slow
def test_no_group_is_trained_past_the_staleness_bound_when_completion_lengths_vary_widely(tmp_path):
    # multi-turn trajectories of 1 to 6 turns, and a reward that takes 0.5 s per turn for one prompt in four: such
    # groups finish steps after groups started after them (taken in completion order, as before, some steps
    # here trained groups 2 versions behind; see tests/rollout/test_executor.py for the exact bound)
    trial = "varied"
    overrides = [f"run.trial={trial}", "experiment=mod10_multi_turn", "workflow.max_turns=6", "run.max_steps=8"]
    overrides += ["rollout.max_staleness=1", "rollout.prompts_per_step=8", "eval.stop_at_accuracy=0"]
    overrides += ["reward.fn=tests.controller.rewards:mod10_slow_for_some", "reward.workers=8"]
    result = run_job(tmp_path, *overrides, "eval.every_steps=0")
    summary_of(result)
    # 8 reward processes, each started with python -m hpcrl.reward.worker: runpy warned in each that its module was
    # imported before it ran (the package's __init__ imported it)
    assert "RuntimeWarning" not in result.stderr, result.stderr[-3000:]
    rows = metrics_of(tmp_path / "mod10_multi_turn" / trial)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert max(r["completion_len_max"] / r["completion_len_min"] for r in rows) >= 4, "lengths vary widely"
    assert all(r["staleness_max"] <= 1 for r in rows), [(r["step"], r["staleness_max"]) for r in rows]
    assert any(r["staleness_max"] == 1 for r in rows), "the rollout ran ahead of training"


@pytest.mark.slow
def test_a_run_whose_every_group_is_rejected_fails_saying_why_and_what_to_change(tmp_path):
    # before, the rollout started replacements forever: no step, no error, no log line
    overrides = ["run.trial=rejected", "reward.fn=tests.controller.rewards:always_raises", "rollout.prompts_per_step=8"]
    result = run_job(tmp_path, *overrides, timeout=300)
    assert result.returncode != 0
    message = "the rollout is stuck: 32 groups in a row were rejected and none accepted "
    message += "(rollout.max_rejected_in_a_row=32): 32 reward errors, 0 all-equal rewards, 0 too long, 0 failed."
    assert message in result.stderr, result.stderr[-3000:]
    assert "or set reward.on_error=zero (last: 8 of 8 failed: " in result.stderr, result.stderr[-3000:]
    assert "no score for" in result.stderr
    assert not (tmp_path / "default" / "rejected" / "metrics.jsonl").read_text(), "no step was trained"


@pytest.mark.slow
def test_two_runs_with_the_same_seed_sample_the_same_rewards(tmp_path):
    # synchronous rollout, one server: every request carries a sampling seed derived from run.seed, the row and
    # the sample, and the batches are taken in start order, so the samples, and their rewards, repeat exactly
    overrides = ["run.max_steps=5", "rollout.max_staleness=0", "eval.stop_at_accuracy=0", "eval.every_steps=0"]
    runs = []
    for trial in ("first", "second"):
        summary_of(run_job(tmp_path, f"run.trial={trial}", *overrides))
        runs.append(metrics_of(tmp_path / "default" / trial))
    first, second = runs
    for key in ("reward_mean", "reward_std", "completion_len_mean"):
        assert [r[key] for r in first] == [r[key] for r in second], key
    # the losses agree to float32 rounding: the server's batches (which requests decode together) differ
    assert [r["loss"] for r in first] == pytest.approx([r["loss"] for r in second], rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "overrides"), [("trainer-1", ["allocation.trainer.workers=2"]), ("critic-0", ["algorithm=ppo"])]
)
def test_a_killed_trainer_or_critic_rank_fails_the_run_fast_and_leaves_nothing(tmp_path, victim, overrides):
    run_dir = tmp_path / "default" / "kill"
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", "run.trial=kill", "run.max_steps=1000"]
    cmd += ["eval.stop_at_accuracy=0", *overrides]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(metrics_of(run_dir)) < 2:
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.5)
        os.kill(json.loads((run_dir / "registry" / f"{victim}.json").read_text())["pid"], signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = job.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert took < 60, f"the controller took {took:.0f} s to notice"
    role, rank = victim.split("-")
    assert f"{role} worker {rank}" in stderr, stderr[-3000:]
    time.sleep(1)
    assert not processes_of(str(run_dir)), "no process of the run may be left alive"
