"""``python -m hpcrl.doctor`` for a Slurm cluster where Slurm's commands are not, and with ``--no-jobs``: every
check it can make runs, and nothing is submitted."""

import os
import stat

from tests.doctor.conftest import run_doctor

LOCAL_CHECKS = ["config", "run root", "address", "ports", "setup timeout"]


def test_without_slurm_every_other_check_runs_and_slurm_is_one_failed_line(tmp_path, path_without_slurm):
    # before: a FileNotFoundError traceback for 'sbatch' after the sbatch lines, and no line for what followed
    doctor = run_doctor("cluster=slurm", f"run.root={tmp_path}", env={"PATH": path_without_slurm})
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "Traceback" not in doctor.stderr, doctor.stderr
    assert list(doctor.lines) == [*LOCAL_CHECKS, "slurm", "gpu"], doctor.stdout
    assert doctor.lines["slurm"] == (
        "fail  slurm: cluster.kind=slurm, but no Slurm commands on PATH here: no sbatch checks and no probe jobs "
        "(not checked: network, run root on nodes); run the doctor on a login node of the cluster, where sbatch, "
        "squeue and scancel are, or pick a local cluster (cluster=local) to run on this machine"
    )
    assert doctor.status("gpu") == "skip"  # cpu_tiny asks for no GPU
    assert list(tmp_path.iterdir()) == [], "no probe folder, no script"


def fake_slurm(bin_dir, calls) -> None:
    """sbatch, squeue and scancel that write their arguments to ``calls``; sbatch --test-only answers as Slurm does,
    a submission prints a job id."""
    bin_dir.mkdir()
    answer = 'echo "sbatch: Job 7 to start at $(date +%Y-%m-%dT%H:%M:%S) using 1 processors on nodes n1" >&2'
    scripts = {
        "sbatch": f'echo "sbatch $*" >> {calls}\nif [ "$1" = --test-only ]; then cat > /dev/null; {answer}; '
        "else echo 99; fi",
        "squeue": f'echo "squeue $*" >> {calls}',
        "scancel": f'echo "scancel $*" >> {calls}',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_no_jobs_makes_every_check_but_the_probe_jobs_and_submits_nothing(tmp_path, path_without_slurm):
    calls = tmp_path / "calls"
    fake_slurm(tmp_path / "bin", calls)
    path = f"{tmp_path / 'bin'}{os.pathsep}{path_without_slurm}"
    doctor = run_doctor("cluster=slurm", "algorithm=ppo", f"run.root={tmp_path}/runs", "--no-jobs", env={"PATH": path})
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    sbatch = ["sbatch server", "sbatch trainer", "sbatch critic", "sbatch hetjob", "sbatch controller"]
    assert list(doctor.lines) == [*LOCAL_CHECKS, *sbatch, "compute nodes", "gpu"], doctor.stdout
    assert all(doctor.status(check) == "ok" for check in sbatch), doctor.stdout
    assert doctor.lines["compute nodes"] == (
        "skip  compute nodes: --no-jobs: no probe job submitted; not checked: network, run root on nodes"
    )
    assert calls.read_text().splitlines() == ["sbatch --test-only"] * 5  # no submission, nothing to cancel
    assert list((tmp_path / "runs").iterdir()) == [], "no probe folder"
