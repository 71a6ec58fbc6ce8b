"""Preemption on the real test Slurm: the controller job gets Slurm's warning signal (USR2, as at its time
limit or when preempted), checkpoints at the next step boundary, requeues itself, and the requeued job
resumes from that checkpoint to the step budget. Both ways of submitting: the Hydra submitit launcher, and
the hand-submitted script of ``python -m hpcrl.sbatch controller``."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import release_when_requeued, wait_for_job
from tests.slurm.test_controller_job import experiment, job_folder, job_folders

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 10
# workers inside the controller job (cluster=local): the controller's own job is what Slurm signals;
# checkpoint.every_steps=0, so the only checkpoint is the one the signal makes
RUN = [f"run.max_steps={STEPS}", "eval.stop_at_accuracy=0", "rollout.prompts_per_step=8", "checkpoint.every_steps=0"]


def metrics_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def signal_after_steps(job_id: str, run_dir: Path, steps: int, alive, batch: bool) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 300
    while len(metrics_steps(run_dir)) < steps:
        assert alive(), "the run ended before it was signalled"
        assert time.monotonic() < deadline, f"fewer than {steps} steps within 300 s"
        time.sleep(0.3)
    # as Slurm does before the time limit: to the job's steps (submitit's --signal=USR2@N, the controller runs
    # in an srun step), or to the batch script (the hand-submitted script's B:USR2@N: it exec'd the controller)
    subprocess.run(["scancel", "--signal=USR2", *(["--batch"] if batch else []), job_id], check=True, timeout=30)
    release_when_requeued(job_id)  # the requeued job starts at once, not after Slurm's fixed 2-minute hold


def check_resumed(run_dir: Path, summary: dict) -> None:
    assert summary["steps"] == STEPS, summary
    resumed = summary.get("resumed_from_step")
    assert resumed and 3 <= resumed < STEPS, summary
    assert metrics_steps(run_dir) == list(range(1, STEPS + 1)), "every step once: none repeated, none skipped"
    assert (run_dir / "checkpoints" / f"step_{resumed:06d}").is_dir()


def test_the_launcher_job_checkpoints_requeues_and_resumes_on_the_signal(slurm_cluster, job_prefix, tmp_path):
    exp = experiment(job_prefix)
    cmd = [sys.executable, "-m", "hpcrl.main", "-m", "hydra/launcher=submitit_slurm", "cluster=local"]
    cmd += [f"cluster.controller.partition={slurm_cluster.partition}", "cluster.controller.time_min=15"]
    cmd += [f"run.root={tmp_path}", f"run.experiment={exp}", "run.trial=p", *RUN]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sweep_dir = tmp_path / exp / "p"  # with -m: the job's run directory is p/0, the launcher's logs p/.submitit
    run_dir = sweep_dir / "0"
    deadline = time.monotonic() + 120
    while not (sweep_dir / ".submitit").is_dir() or not job_folders(sweep_dir):  # files may come before the folder
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.3)
    job_id = job_folder(sweep_dir).name
    signal_after_steps(job_id, run_dir, 3, lambda: proc.poll() is None, batch=False)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    rows = wait_for_job(job_id, timeout_s=60)
    assert rows[job_id]["State"] == "COMPLETED", rows
    out = "".join(p.read_text() for p in job_folder(sweep_dir).glob("*_0_log.out"))
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    check_resumed(run_dir, summary)


def test_the_hand_submitted_controller_script_requeues_and_resumes(slurm_cluster, job_prefix, tmp_path):
    exp = job_prefix.removeprefix("hpcrl-").rstrip("-")
    script = tmp_path / "controller.sbatch"
    render = [sys.executable, "-m", "hpcrl.sbatch", "controller", "cluster=slurm_local", f"run.experiment={exp}"]
    subprocess.run([*render, "--write", str(script)], check=True, timeout=120, capture_output=True)
    args = ["cluster=local", f"run.root={tmp_path}", *RUN]  # no run.trial: the script names it after its job
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    run_dir = tmp_path / exp / f"slurm-{job_id}"  # the requeued job keeps its id, and so its run directory
    signal_after_steps(job_id, run_dir, 3, lambda: True, batch=True)
    rows = wait_for_job(job_id, timeout_s=400)
    output = (tmp_path / f"hpcrl-{job_id}.out").read_text()
    assert rows[job_id]["State"] == "COMPLETED", (rows, output[-3000:])
    summary = json.loads([line for line in output.splitlines() if line.startswith("{")][-1])
    check_resumed(run_dir, summary)
    assert summary["run_dir"] == str(run_dir) and [p.name for p in (tmp_path / exp).iterdir()] == [run_dir.name]
