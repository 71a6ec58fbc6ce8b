"""The doctor against the real test Slurm: it passes, a broken setting fails its line with advice, and no
probe job is left in the queue on any path (the ``no_leftover_jobs`` fixture checks every test)."""

import signal
import subprocess
import sys
import time

import pytest

from hpcrl.net import discover_host, has_ipv6
from tests.conftest import REPO
from tests.doctor.conftest import run_doctor

pytestmark = pytest.mark.slurm
LATER = 'cluster.extra_sbatch=["--begin=now+1hour"]'  # a probe job that stays PENDING


def test_the_doctor_passes_on_the_test_slurm(slurm_cluster, job_prefix, tmp_path):
    # algorithm=ppo: the critic is a role of the run, with a job (and a hetjob component) of its own
    doctor = run_doctor("cluster=slurm_local", "algorithm=ppo", f"run.root={tmp_path}", "--job-prefix", job_prefix)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    for check in ("sbatch server", "sbatch trainer", "sbatch critic", "sbatch hetjob", "sbatch controller", "network"):
        assert doctor.status(check) == "ok", doctor.stdout
    assert "+critic:d1" in doctor.lines["config"] and "critic 180 s" in doctor.lines["setup timeout"], doctor.stdout
    assert doctor.status("run root on nodes") == "ok"
    assert "and this machine reached node" in doctor.lines["network"]
    assert doctor.status("gpu") == "skip"
    assert list(tmp_path.iterdir()) == []  # the probe folder is gone


@pytest.mark.skipif(not has_ipv6(), reason="this machine has no IPv6")
def test_the_network_check_runs_over_ipv6(slurm_cluster, job_prefix, tmp_path):
    doctor = run_doctor("cluster=slurm_local", f"run.root={tmp_path}", "cluster.net.family=ipv6", "--job-prefix",
                        job_prefix)  # fmt: skip
    assert doctor.status("network") == "ok", doctor.stdout
    assert f"[{discover_host('ipv6', 'hpcrl0')}]:" in doctor.lines["network"]  # slurm_local's interface


def test_an_address_that_is_loopback_on_the_nodes_fails_the_network_check(slurm_cluster, job_prefix, tmp_path):
    """Every node is a host of its own: 127.0.0.1 on a node is that node, so the probe cannot reach this machine."""
    doctor = run_doctor("cluster=slurm_local", f"run.root={tmp_path}", "cluster.net.advertise_host=127.0.0.1",
                        "--job-prefix", job_prefix)  # fmt: skip
    assert doctor.status("network") == "fail", doctor.stdout
    assert "cannot reach the controller at 127.0.0.1:" in doctor.lines["network"], doctor.lines["network"]
    assert "set cluster.net.interface" in doctor.lines["network"]


def test_a_partition_that_does_not_exist_fails_every_sbatch_line(slurm_cluster, job_prefix, tmp_path):
    doctor = run_doctor("cluster=slurm_local", f"run.root={tmp_path}", "cluster.partition=no_such_partition",
                        "--job-prefix", job_prefix)  # fmt: skip
    assert doctor.returncode == 1
    for check in ("sbatch server", "sbatch trainer", "sbatch hetjob", "sbatch controller"):
        assert doctor.status(check) == "fail"
        assert "invalid partition specified: no_such_partition" in doctor.lines[check]
        assert "sinfo -s lists partitions" in doctor.lines[check]
    assert doctor.status("network") == "fail"  # its probe job cannot be submitted either


@pytest.mark.parametrize(
    ("check", "overrides"),
    [
        ("run root", ["run.root={tmp}/a_file/runs"]),
        ("ports", ["cluster.net.port_min=40000", "cluster.net.port_max=41000"]),
        ("setup timeout server", ["model=local", "model.path={tmp}", "cluster.roles.server.setup_timeout_s=10"]),
    ],
)
def test_a_broken_setting_fails_its_line_on_slurm_too(slurm_cluster, job_prefix, tmp_path, check, overrides):
    (tmp_path / "a_file").write_text("")
    for name, data in (("model.safetensors", b"\0" * 1000), ("config.json", b"{}"), ("tokenizer.json", b"{}")):
        (tmp_path / name).write_bytes(data)  # a model directory as the config's check wants it
    args = [o.format(tmp=tmp_path) for o in overrides]
    doctor = run_doctor("cluster=slurm_local", f"run.root={tmp_path}/runs", *args, "--job-prefix", job_prefix)
    assert doctor.returncode == 1
    assert doctor.status(check) == "fail", doctor.stdout


def test_a_node_that_cannot_reach_the_advertised_address_fails(slurm_cluster, job_prefix, tmp_path):
    # the doctor listens on loopback only, but advertises this machine's address: a node's connect is refused
    doctor = run_doctor("cluster=slurm_local", f"run.root={tmp_path}", f"cluster.net.advertise_host={discover_host()}",
                        "cluster.net.bind_host=127.0.0.1", "--job-prefix", job_prefix)  # fmt: skip
    assert doctor.returncode == 1
    assert doctor.status("network") == "fail"
    assert "cannot reach the controller at" in doctor.lines["network"]
    assert "set cluster.net.interface" in doctor.lines["network"]


def test_probe_jobs_that_do_not_start_by_the_deadline_are_cancelled(slurm_cluster, job_prefix, tmp_path):
    doctor = run_doctor("cluster=slurm_local", f"run.root={tmp_path}", LATER, "--job-prefix", job_prefix,
                        "--job-timeout-s", "2")  # fmt: skip
    assert doctor.returncode == 0, doctor.stdout  # not checked is a warning, not a failure
    for check in ("network", "run root on nodes"):
        assert doctor.status(check) == "warn"
        assert "not checked" in doctor.lines[check] and "PENDING (reason: BeginTime)" in doctor.lines[check]


def test_sigterm_cancels_the_probe_jobs(slurm_cluster, job_prefix, tmp_path):
    argv = [sys.executable, "-m", "hpcrl.doctor", "cluster=slurm_local", f"run.root={tmp_path}", LATER,
            "--job-prefix", job_prefix, "--job-timeout-s", "120"]  # fmt: skip
    doctor = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_queued(job_prefix)) < 2:
            assert time.monotonic() < deadline and doctor.poll() is None, "the probe jobs were never queued"
            time.sleep(0.2)
        doctor.send_signal(signal.SIGTERM)
        doctor.wait(timeout=60)
    finally:
        doctor.kill()
        doctor.communicate()
    assert doctor.returncode == 128 + signal.SIGTERM
    assert _queued(job_prefix) == []


def _queued(prefix: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-a", "-o", "%j"], capture_output=True, text=True, timeout=30).stdout
    return [name for name in out.split() if name.startswith(prefix)]
