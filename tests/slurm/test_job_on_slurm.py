"""The default tiny job with its workers on the real test Slurm, in both submit modes (the heterogeneous job
with rollout workers as a third component)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hetjob", "per_role"])
def test_tiny_job_runs_its_workers_as_slurm_jobs(slurm_cluster, job_prefix, tmp_path, mode):
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")  # job names: hpcrl-<experiment>-<role>...
    cmd = [sys.executable, "-m", "hpcrl.main", "cluster=slurm_local", f"cluster.submit_mode={mode}"]
    cmd += [f"run.root={tmp_path}", f"run.experiment={experiment}", "run.trial=t", "run.max_steps=3"]
    cmd += ["eval.stop_at_accuracy=0", "rollout.prompts_per_step=16"]
    if mode == "hetjob":  # with rollout workers too: a third component
        cmd += ["rollout.workers=2", "reward.workers=1"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and "eval_accuracy_after" in summary
    ids = [job_id for job_id, _, _ in _jobs_named(job_prefix)]
    if mode == "hetjob":  # one job whose components are the roles
        assert {i.rsplit("+", 1)[-1] for i in ids} == {"0", "1", "2"}, ids  # server, trainer, rollout
    else:  # one job per role
        assert len(ids) == 2 and not any("+" in i for i in ids), ids


def _jobs_named(prefix: str) -> list[list[str]]:
    """(job id, name, state) from sacct of this hour's jobs (hetjob components as ID+k) named PREFIX..."""
    cmd = ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State", "-S", "now-1hours"]
    rows = [
        line.split("|") for line in subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.splitlines()
    ]
    return [row for row in rows if len(row) == 3 and row[1].startswith(prefix)]
