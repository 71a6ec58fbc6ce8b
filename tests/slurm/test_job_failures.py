"""The whole job on the real test Slurm when a worker job fails: the controller fails fast, naming the job
and its state, and leaves nothing in the queue (``no_leftover_jobs`` checks squeue after every test)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from hpcrl.launch.registry import Registry
from tests.conftest import REPO
from tests.controller.test_job import wait_for_steps

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FAIL_WITHIN_S = 30  # from the worker job's end to the controller's exit


def start_job(tmp_path: Path, job_prefix: str, *overrides: str, mode: str = "per_role") -> subprocess.Popen:
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")  # worker jobs: hpcrl-<experiment>-<role>
    cmd = [sys.executable, "-m", "hpcrl.main", "cluster=slurm_local", f"cluster.submit_mode={mode}"]
    cmd += [f"run.root={tmp_path}", f"run.experiment={experiment}", "run.trial=t", *overrides]
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    """The exit code, stderr and the time (epoch seconds) the controller exited; killed after the deadline."""
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the controller has not exited after {timeout_s} s:\n{stderr[-3000:]}")
    return proc.returncode, stderr, time.time()


def job_named(name: str, timeout_s: float = 120) -> str:
    """The id of the job squeue or sacct shows with this name (waits for it to be submitted)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cmd = ["sacct", "-X", "-n", "-P", "-o", "JobID", "-S", "now-1hours", "--name", name]
        ids = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.split()
        if ids:
            return ids[-1]
        time.sleep(0.5)
    pytest.fail(f"no job named {name} within {timeout_s} s")


def ended_at(job_id: str, timeout_s: float = 30) -> float:
    """When sacct says the job ended (epoch seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cmd = ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "End"]
        end = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        if end and end != "Unknown":
            return datetime.fromisoformat(end).timestamp()
        assert time.monotonic() < deadline, f"sacct shows no end for job {job_id}"
        time.sleep(0.5)


def run_dir_of(tmp_path: Path, job_prefix: str) -> Path:
    return tmp_path / job_prefix.removeprefix("hpcrl-").rstrip("-") / "t"


def test_a_server_job_that_exits_at_start_fails_the_run_naming_it(slurm_cluster, job_prefix, tmp_path):
    # a site's setup line that fails (a module that does not load, say): the job exits before any worker runs
    proc = start_job(tmp_path, job_prefix, "cluster.roles.server.setup=['echo no such module >&2; exit 3']")
    code, stderr, exited = finish(proc, timeout_s=240)
    job_id = job_named(f"{job_prefix}server")
    assert code == 1, stderr[-3000:]
    assert f"server worker job {job_id}" in stderr and "FAILED" in stderr, stderr[-3000:]
    assert "no such module" in stderr, "the job's own output is in the error"
    assert exited - ended_at(job_id) < FAIL_WITHIN_S, (exited, ended_at(job_id))


def test_a_worker_job_cancelled_mid_run_fails_the_run_naming_it(slurm_cluster, job_prefix, tmp_path):
    proc = start_job(tmp_path, job_prefix, "run.max_steps=500", "eval.stop_at_accuracy=0", "rollout.prompts_per_step=8")
    wait_for_steps(proc, run_dir_of(tmp_path, job_prefix), 2)
    job_id = job_named(f"{job_prefix}server")
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    cancelled = time.time()
    code, stderr, exited = finish(proc, timeout_s=120)
    assert code == 1, stderr[-3000:]
    assert f"server worker job {job_id}" in stderr and "CANCELLED" in stderr, stderr[-3000:]
    assert exited - cancelled < FAIL_WITHIN_S


def test_with_restart_a_dead_server_job_is_submitted_again_and_rejoins(slurm_cluster, job_prefix, tmp_path):
    overrides = ("run.max_steps=10", "eval.stop_at_accuracy=0", "rollout.prompts_per_step=8")
    proc = start_job(tmp_path, job_prefix, *overrides, "inference.on_server_exit=restart")
    run_dir = run_dir_of(tmp_path, job_prefix)
    wait_for_steps(proc, run_dir, 2)
    first = job_named(f"{job_prefix}server")
    (entry,) = Registry(run_dir / "registry").entries("server")
    os.kill(entry.extra["server_pid"], signal.SIGKILL)  # the inference server crashes; srun ends the job's step
    code, stderr, _ = finish(proc, timeout_s=400)
    assert code == 0, stderr[-3000:]
    assert f"server worker job {first}" in stderr and "restarting it" in stderr, stderr[-3000:]
    second = job_named(f"{job_prefix}server")
    assert second != first, "the server role ran again in a job of its own"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert rows[-1]["servers_restarted"] == 1
    assert re.search(r"server worker 0 is back in the pool at \S+ with weights version [1-9]", stderr), stderr[-3000:]


def test_a_critic_rank_killed_mid_run_fails_the_hetjob_run_naming_the_critic(slurm_cluster, job_prefix, tmp_path):
    """algorithm=ppo: the critic is component 2 of the workers' heterogeneous job; one of its ranks dies (SIGKILL,
    as the OOM killer does), torchrun ends the other, the job ends, and the run fails naming the critic."""
    overrides = ("algorithm=ppo", "allocation.critic.workers=2", "run.max_steps=500", "eval.stop_at_accuracy=0")
    proc = start_job(tmp_path, job_prefix, *overrides, "rollout.prompts_per_step=8", mode="hetjob")
    run_dir = run_dir_of(tmp_path, job_prefix)
    wait_for_steps(proc, run_dir, 2)
    (victim,) = [e for e in Registry(run_dir / "registry").entries("critic") if e.rank == 1]
    os.kill(victim.pid, signal.SIGKILL)  # the nodes are network namespaces: their PIDs are this host's
    killed = time.time()
    code, stderr, exited = finish(proc, timeout_s=120)
    job_id = job_named(f"{job_prefix}critic")
    assert code == 1, stderr[-3000:]
    assert job_id.endswith("+2"), job_id  # server +0, trainer +1, critic +2
    # the critic, though the server's component (checked first) ended FAILED with it
    assert f"hpcrl: the run failed (WorkerFailed): critic worker job {job_id} FAILED" in stderr, stderr[-3000:]
    assert "Signal 9 (SIGKILL) received by PID" in stderr, "torchrun's report of the dead rank is in the error"
    assert exited - killed < FAIL_WITHIN_S, (exited, killed)
