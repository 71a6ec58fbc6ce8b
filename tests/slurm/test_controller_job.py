"""The controller job: ``python -m hpcrl.main -m hydra/launcher=submitit_slurm cluster=SITE ...`` runs the
controller itself as one Slurm job, with the partition, time limit and CPUs of the cluster group's
``controller`` (hpcrl/config/launcher.py); with ``hydra/launcher=submitit_local`` the same
command runs it on this machine. The submitting command waits for the job and exits with its outcome.

The sweep directory ``<root>/<experiment>/<trial>`` is the same in the submitting process and in the jobs: the
launcher makes it (conf/config.yaml) and keeps each job's stdout and stderr in its ``.submitit/<job id>/``;
each job of the sweep runs in a run directory of its own beside that, ``<trial>/<job number>/``.

With cluster=slurm_local the controller job submits its workers as Slurm jobs in turn (one heterogeneous job
here); with cluster=local they are subprocesses inside the controller job.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hpcrl.config.hydra import register_schema
from tests.config.compose import load
from tests.conftest import CONF_DIR
from tests.slurm.conftest import wait_for_job
from tests.slurm.test_job_on_slurm import check_addresses, check_group_on_trainer_node

# a few steps of the tiny job: enough for a summary with evaluations before and after
TINY_JOB = ("run.max_steps=3", "eval.stop_at_accuracy=0", "rollout.prompts_per_step=16")
SUMMARY_KEYS = {"steps", "wall_s", "eval_accuracy_before", "eval_accuracy_after", "run_dir"}
DRY_RUN_TIMEOUT_S = 120
TINY_JOB_TIMEOUT_S = 420


def submit(tmp_path: Path, *overrides: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``python -m hpcrl.main -m OVERRIDES run.root=TMP_PATH``, which returns when its job has ended.

    In its own session, so that on the deadline the whole process group goes; a job it left in Slurm is
    cancelled by ``no_leftover_jobs``.
    """
    cmd = [sys.executable, "-m", "hpcrl.main", "-m", *overrides, f"run.root={tmp_path}"]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} has not ended after {timeout_s} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def experiment(job_prefix: str) -> str:
    """A run.experiment whose controller job (``hpcrl-<experiment>``) is named with the test's job prefix."""
    return job_prefix.removeprefix("hpcrl-") + "ctl"


def job_folders(sweep_dir: Path) -> list[Path]:
    """``<sweep dir>/.submitit/<job id>``: the controller jobs' pickles and logs, in submission order."""
    # submitit also makes a folder named after its pattern (%j), which stays empty
    folders = [p for p in (sweep_dir / ".submitit").iterdir() if p.is_dir() and p.name != "%j"]
    tasks = [p for p in folders if "_" in p.name]  # a sweep on Slurm is a job array: <id>_<task> for each job
    return sorted(tasks or folders, key=lambda p: [int(part) for part in re.findall(r"\d+", p.name)])


def job_folder(sweep_dir: Path) -> Path:
    """The one controller job's folder."""
    (folder,) = job_folders(sweep_dir)
    return folder


def job_stdout(folder: Path) -> str:
    """What the job printed on stdout, without submitit's own log lines (``submitit INFO (...) - ...``)."""
    (log,) = folder.glob("*_0_log.out")
    return "".join(line for line in log.read_text().splitlines(True) if not line.startswith("submitit "))


def summary_in(stdout: str) -> dict:
    """The job's summary: the JSON object on the last line of its stdout."""
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert set(summary) >= SUMMARY_KEYS, summary
    return summary


def sacct_allocation(job_id: str, fields: list[str], timeout_s: float = 15) -> dict[str, str]:
    """sacct's FIELDS of JOB_ID's allocation (no steps), once its accounting record is complete.

    For a moment after a job ends, sacct may still show its allocation as JobName "allocation".
    """
    fields = ["JobName", *fields]
    deadline = time.monotonic() + timeout_s
    while True:
        result = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", ",".join(fields)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        (line,) = result.stdout.splitlines()
        row = dict(zip(fields, line.split("|"), strict=True))
        if row["JobName"] != "allocation" or time.monotonic() > deadline:
            return row
        time.sleep(0.5)


def launcher_config(*overrides: str) -> dict:
    """The composed ``hydra.launcher``, resolved."""
    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        return {key: cfg.hydra.launcher[key] for key in cfg.hydra.launcher}


def test_the_cluster_group_sizes_the_controller_job():
    site = load("cluster=slurm").cluster
    launcher = launcher_config("hydra/launcher=submitit_slurm", "cluster=slurm", "run.experiment=exp")
    assert launcher["name"] == "hpcrl-exp"
    assert launcher["partition"] == site.partition == "gpu"  # controller.partition "" = the cluster's
    assert launcher["timeout_min"] == site.time_min == 240  # controller.time_min follows the cluster's
    assert launcher["cpus_per_task"] == site.controller.cpus == 4
    assert launcher["mem_gb"] == site.controller.mem_gb == 16
    assert 2 <= launcher["signal_delay_s"] <= 120, "submitit signals the job this long before its time limit"
    assert launcher["submitit_folder"].endswith("/.submitit/%j")

    launcher = launcher_config(
        "hydra/launcher=submitit_slurm",
        "cluster=slurm_local",
        "cluster.controller.partition=cpu",
        "cluster.controller.time_min=30",
        "cluster.controller.cpus=2",
    )
    assert (launcher["partition"], launcher["timeout_min"], launcher["cpus_per_task"]) == ("cpu", 30, 2)


def test_other_launchers_ignore_the_controller_job_settings():
    assert set(launcher_config("cluster=slurm")) == {"_target_"}  # the basic launcher: this process
    local = launcher_config("hydra/launcher=submitit_local", "cluster=slurm")
    assert local["_target_"].endswith(".LocalLauncher") and "partition" not in local


def test_each_job_of_a_sweep_runs_in_its_own_directory_under_the_trial(tmp_path):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=submitit_slurm", f"run.root={tmp_path}", "run.experiment=exp"],
            return_hydra_config=True,
        )
        sweep = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)
        assert (cfg.hydra.sweep.dir, sweep["subdir"]) == (str(tmp_path / "exp" / cfg.run.trial), "${hydra.job.num}")
        assert re.fullmatch(r"\d{8}-\d{6}", cfg.run.trial)


@pytest.mark.slurm
def test_dry_run_as_a_slurm_job_with_the_cluster_groups_resources(slurm_cluster, job_prefix, tmp_path):
    exp = experiment(job_prefix)
    overrides = ["cluster=slurm_local", f"cluster.partition={slurm_cluster.partition}", f"run.experiment={exp}"]
    started = time.monotonic()
    result = submit(
        tmp_path, "hydra/launcher=submitit_slurm", *overrides, "run.dry_run=true", timeout_s=DRY_RUN_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"dry run under the Slurm launcher: {time.monotonic() - started:.1f} s")
    # a dry run submits nothing (it once submitted a job that then checked the config): it prints the controller
    # job's settings, resolved from the cluster group, then the job's config, and makes no run directory
    settings, job = yaml.safe_load_all(result.stdout)
    cluster = load(*overrides).cluster
    assert (settings["name"], settings["partition"]) == (
        f"hpcrl-{exp}",
        cluster.controller.partition or cluster.partition,
    )
    assert settings["cpus_per_task"] == cluster.controller.cpus
    assert settings["timeout_min"] == (cluster.controller.time_min or cluster.time_min)
    assert re.fullmatch(r"\d{8}-\d{6}", job["run"]["trial"]) and job["cluster"]["name"] == "slurm_local"
    assert "nothing was submitted" in result.stderr
    assert not (tmp_path / exp).exists(), "no run directory, no .submitit folder"


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_job_runs_inside_the_slurm_controller_job(slurm_cluster, job_prefix, tmp_path):
    exp = experiment(job_prefix)
    started = time.monotonic()
    result = submit(
        tmp_path,
        "hydra/launcher=submitit_slurm",
        "cluster=local",
        f"cluster.controller.partition={slurm_cluster.partition}",
        "cluster.controller.time_min=10",
        f"run.experiment={exp}",
        "run.trial=tiny",
        *TINY_JOB,
        timeout_s=TINY_JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"tiny job as a Slurm job: {time.monotonic() - started:.1f} s")
    run_dir = tmp_path / exp / "tiny" / "0"
    folder = job_folder(run_dir.parent)
    summary = summary_in(job_stdout(folder))
    assert summary["steps"] == 3 and summary["run_dir"] == str(run_dir), summary
    assert (run_dir / "metrics.jsonl").is_file()
    rows = wait_for_job(folder.name)
    assert rows[folder.name]["State"] == "COMPLETED" and rows[folder.name]["ExitCode"] == "0:0", rows


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_tiny_job_through_the_submitit_launcher_with_its_workers_on_slurm(slurm_cluster, job_prefix, tmp_path, sync):
    exp = experiment(job_prefix)
    started = time.monotonic()
    result = submit(
        tmp_path,
        "hydra/launcher=submitit_slurm",
        "cluster=slurm_local",
        f"cluster.partition={slurm_cluster.partition}",
        f"run.experiment={exp}",
        "run.trial=tiny",
        f"train.weight_sync={sync}",
        *TINY_JOB,
        timeout_s=TINY_JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"tiny job through the launcher, workers on Slurm: {time.monotonic() - started:.1f} s")
    run_dir = tmp_path / exp / "tiny" / "0"
    folder = job_folder(run_dir.parent)
    summary = summary_in(job_stdout(folder))
    assert summary["steps"] == 3 and summary["run_dir"] == str(run_dir), summary
    controller = wait_for_job(folder.name)
    assert controller[folder.name]["State"] == "COMPLETED", controller
    # the controller job submitted the workers as one heterogeneous job: server +0, trainer +1
    cmd = ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State", "-S", "now-1hours"]
    rows = [
        line.split("|") for line in subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.splitlines()
    ]
    workers = {name: job_id for job_id, name, _ in rows if name.startswith(f"hpcrl-{exp}-")}
    assert set(workers) == {f"hpcrl-{exp}-server", f"hpcrl-{exp}-trainer"}, rows
    assert workers[f"hpcrl-{exp}-server"].endswith("+0") and workers[f"hpcrl-{exp}-trainer"].endswith("+1")
    check_addresses(run_dir, "auto")  # the controller ran on a node too: every party is a host of its own
    if sync == "distributed":
        check_group_on_trainer_node(run_dir)


@pytest.mark.slow
def test_tiny_job_runs_as_a_local_controller_job(tmp_path):
    started = time.monotonic()
    result = submit(
        tmp_path, "hydra/launcher=submitit_local", "run.trial=tiny", *TINY_JOB, timeout_s=TINY_JOB_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"tiny job as a local job: {time.monotonic() - started:.1f} s")
    run_dir = tmp_path / "default" / "tiny" / "0"
    summary = summary_in(job_stdout(job_folder(run_dir.parent)))
    assert summary["steps"] == 3 and summary["run_dir"] == str(run_dir), summary
    # the submitting terminal says where the run and its log are before it submits, and prints the summary at the end
    sweep = run_dir.parent
    assert f"runs in {sweep}/<job number>/" in result.stderr
    assert f"follow it in {sweep}/<job number>/logs/controller-0.log" in result.stderr
    assert summary_in(result.stdout) == summary


@pytest.mark.slow
def test_a_two_point_sweep_on_the_local_launcher_gives_each_job_its_own_run(tmp_path):
    result = submit(
        tmp_path,
        "hydra/launcher=submitit_local",
        "run.trial=sweep",
        "algorithm=grpo,dapo",
        *TINY_JOB,
        timeout_s=TINY_JOB_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    sweep_dir = tmp_path / "default" / "sweep"
    secrets = set()
    for num, (folder, algorithm) in enumerate(zip(job_folders(sweep_dir), ["grpo", "dapo"], strict=True)):
        run_dir = sweep_dir / str(num)
        summary = summary_in(job_stdout(folder))
        assert summary["steps"] == 3 and summary["run_dir"] == str(run_dir), summary
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]["name"] == algorithm
        assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
        secrets.add((run_dir / "secret").read_text())
    assert len(secrets) == 2, "each job has a run secret of its own"


@pytest.mark.slurm
def test_a_two_point_sweep_on_slurm_gives_each_job_its_own_directory(slurm_cluster, job_prefix, tmp_path):
    exp = experiment(job_prefix)
    overrides = [f"cluster.controller.partition={slurm_cluster.partition}", "cluster.controller.time_min=5"]
    result = submit(
        tmp_path,
        "hydra/launcher=submitit_slurm",
        *overrides,
        f"run.experiment={exp}",
        "run.trial=sweep",
        "algorithm=grpo,dapo",
        "run.dry_run=true",
        timeout_s=DRY_RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # a dry run submits nothing: it says where each job would run, and each job's config
    sweep_dir = tmp_path / exp / "sweep"
    _, *jobs = yaml.safe_load_all(result.stdout)
    assert [job["algorithm"]["name"] for job in jobs] == ["grpo", "dapo"]
    for num, algorithm in enumerate(["grpo", "dapo"]):
        assert f"--- # job {num} algorithm={algorithm}: in {sweep_dir / str(num)}" in result.stdout, result.stdout
    assert not sweep_dir.exists()


@pytest.mark.parametrize("launcher", ["submitit_local", pytest.param("submitit_slurm", marks=pytest.mark.slurm)])
def test_a_failing_controller_job_fails_the_command_with_its_error(request, launcher, job_prefix, tmp_path):
    if launcher == "submitit_slurm":
        partition = request.getfixturevalue("slurm_cluster").partition
        where = [f"cluster.controller.partition={partition}", "cluster.controller.time_min=5"]
    else:
        where = []
    exp = experiment(job_prefix)
    # a reward module that raises when it is imported in a submitit job only: the submitting process's checks (which
    # import it, as they do a missing model directory or data file) pass, and the job's own checks fail it
    broken = (
        'import os\nif "SUBMITIT_EXECUTOR" in os.environ:\n    raise RuntimeError("this reward module is broken")\n'
    )
    (tmp_path / "broken_reward.py").write_text(broken + "def score(prompt, completion, answer):\n    return 0.0\n")
    result = submit(
        tmp_path,
        f"hydra/launcher={launcher}",
        *where,
        f"run.experiment={exp}",
        "run.trial=fail",
        "reward.fn=broken_reward:score",
        timeout_s=DRY_RUN_TIMEOUT_S,
    )
    assert result.returncode != 0
    error = (
        "hpcrl: config error: reward.fn='broken_reward:score' is invalid: expected functions every reward process can "
        "import: reward function 'broken_reward:score': cannot import module 'broken_reward': RuntimeError: this "
        "reward module is broken"
    )
    assert error in result.stderr, result.stderr[-4000:]
    sweep = tmp_path / exp / "fail"
    assert f"hpcrl: each job of this sweep runs in {sweep}/<job number>/" in result.stderr  # said before submitting
    # after submitit's report (the job's whole stderr), the job's own last lines: its error is the last of them
    tail = result.stderr[result.stderr.rindex("hpcrl: the controller job failed") :].splitlines()
    assert "the last lines of its stderr" in tail[0] and "_log.err" in tail[0], tail
    assert tail[-1].strip().startswith(error), tail
    folder = job_folder(sweep)  # the sweep directory; the job's run directory is fail/0
    if launcher == "submitit_slurm":
        rows = wait_for_job(folder.name)
        assert rows[folder.name]["State"] == "FAILED", rows
