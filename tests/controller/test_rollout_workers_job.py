"""The job with rollout workers (``rollout.workers``): episodes run in worker processes, and losing one
worker mid-run fails only its episodes, which run again on the others; the run reaches its budget."""

import json
import os
import signal
import subprocess
import sys

import pytest

from hpcrl.launch.registry import Registry
from tests.conftest import REPO
from tests.controller.test_job import frozen_heaps, metrics_of, processes_of, wait_for_steps

pytestmark = pytest.mark.slow

SMALL = ["eval.stop_at_accuracy=0", "rollout.prompts_per_step=8", "rollout.workers=2", "reward.workers=1"]


def start(tmp_path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", "run.trial=t", *SMALL, *overrides]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def summary_of(proc: subprocess.Popen, timeout_s: float = 420) -> dict:
    stdout, stderr = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_episodes_run_on_rollout_workers(tmp_path):
    summary = summary_of(start(tmp_path, "run.max_steps=3"))
    run_dir = tmp_path / "default" / "t"
    assert summary["steps"] == 3 and "eval_accuracy_after" in summary
    assert [r["step"] for r in metrics_of(run_dir)] == [1, 2, 3]
    log = (run_dir / "logs" / "controller-0.log").read_text()
    ran = json.loads(log.split("episodes each rollout worker ran, by rank: ")[1].splitlines()[0])
    assert set(ran) == {"0", "1"} and all(n > 0 for n in ran.values()), ran  # both workers ran episodes
    frozen = frozen_heaps(run_dir)  # each rollout worker froze its start-up heap once it had registered
    assert all(len(frozen.get(f"rollout-{r}", [])) == 1 for r in (0, 1)), frozen
    assert not processes_of(str(run_dir)), "no process of the run outlives it"


def test_a_rollout_worker_killed_mid_run_costs_only_its_episodes(tmp_path):
    proc = start(tmp_path, "run.max_steps=8")
    run_dir = tmp_path / "default" / "t"
    wait_for_steps(proc, run_dir, 2)
    (victim,) = [e for e in Registry(run_dir / "registry").entries("rollout") if e.rank == 1]
    os.kill(victim.pid, signal.SIGKILL)
    summary = summary_of(proc)
    assert summary["steps"] == 8, summary
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, 9))
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert "rollout worker 1" in log, "the loss is logged, naming the worker"
    assert not processes_of(str(run_dir)), "no process of the run outlives it"
