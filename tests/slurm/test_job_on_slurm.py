"""The default tiny job with its workers on the real test Slurm, whose nodes are hosts of their own: both submit
modes (the heterogeneous job with rollout workers as a third component), both weight syncs, and a run whose
own traffic is IPv6 only, whose rollout workers run a plug-in agent from a module outside the package (its
proxy on each node's ``::1``). With ``train.weight_sync=distributed`` the servers join a process group hosted by
trainer rank 0 on its node, at a port chosen there: the log line names that node's address."""

import ipaddress
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.launch.registry import Registry
from tests.conftest import REPO
from tests.controller.test_agent_job import GROUP, plugin_overrides

NODES = ipaddress.ip_network("198.51.100.0/24")
HOST = ipaddress.ip_address("198.51.100.1")  # this machine on the test cluster's network: never a worker's


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "sync", "family"),
    [("hetjob", "disk", "auto"), ("per_role", "disk", "auto"), ("per_role", "distributed", "auto"),
     ("hetjob", "distributed", "ipv6")],
)  # fmt: skip
def test_tiny_job_runs_its_workers_as_slurm_jobs(slurm_cluster, job_prefix, tmp_path, mode, sync, family):
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")  # job names: hpcrl-<experiment>-<role>...
    cmd = [sys.executable, "-m", "hpcrl.main", "cluster=slurm_local", f"cluster.submit_mode={mode}"]
    cmd += [f"run.root={tmp_path}", f"run.experiment={experiment}", "run.trial=t", "run.max_steps=3"]
    cmd += ["eval.stop_at_accuracy=0", "rollout.prompts_per_step=16", f"train.weight_sync={sync}"]
    cmd += [f"cluster.net.family={family}"]
    if mode == "hetjob":  # with rollout workers too: a third component
        cmd += ["rollout.workers=2", "reward.workers=1"]
    env = dict(os.environ)
    if family == "ipv6":  # the rollout workers import a user's agent, found on PYTHONPATH only
        cmd += plugin_overrides(tmp_path)
        env["PYTHONPATH"] = str(tmp_path / "outside")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and "eval_accuracy_after" in summary
    ids = [job_id for job_id, _, _ in _jobs_named(job_prefix)]
    if mode == "hetjob":  # one job whose components are the roles
        assert {i.rsplit("+", 1)[-1] for i in ids} == {"0", "1", "2"}, ids  # server, trainer, rollout
    else:  # one job per role
        assert len(ids) == 2 and not any("+" in i for i in ids), ids
    run_dir = tmp_path / experiment / "t"
    check_addresses(run_dir, family)
    if sync == "distributed":
        check_group_on_trainer_node(run_dir)
    if family == "ipv6":  # every episode ran the plug-in: two completions each
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert all(r["agent_completions"] == 2 * 16 * GROUP for r in rows), rows


def check_addresses(run_dir: Path, family: str) -> None:
    """Every worker advertised its own node's address, of the family asked for."""
    registry = Registry(run_dir / "registry")
    entries = [e for role in ("server", "trainer", "rollout") for e in registry.entries(role)]
    assert entries, "the workers registered"
    for e in entries:
        address = ipaddress.ip_address(e.host)
        assert address.version == (6 if family == "ipv6" else 4), e
        assert address != HOST and (family == "ipv6" or address in NODES), e


def check_group_on_trainer_node(run_dir: Path) -> None:
    """The weight-update group's rendezvous is trainer rank 0's own address, not this machine's."""
    log = (run_dir / "logs" / "controller-0.log").read_text()
    (host,) = re.findall(r"weight-update group formed at trainer rank 0's (\S+):\d+ ", log)
    (rank0,) = [e for e in Registry(run_dir / "registry").entries("trainer") if e.rank == 0]
    assert host == rank0.host, (host, rank0)
    server_log = (run_dir / "logs" / "server-proc-0.log").read_text()
    (joined,) = re.findall(r"joining weight_update_group at (\S+):\d+ as ranks", server_log)
    assert joined == rank0.host, (joined, rank0)  # the server, on another node, dialled trainer rank 0's node
    assert len(re.findall(r"received \d+ tensors", server_log)) >= 3, "a push after every one of the 3 steps"


def _jobs_named(prefix: str) -> list[list[str]]:
    """(job id, name, state) from sacct of this hour's jobs (hetjob components as ID+k) named PREFIX..."""
    cmd = ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State", "-S", "now-1hours"]
    rows = [
        line.split("|") for line in subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.splitlines()
    ]
    return [row for row in rows if len(row) == 3 and row[1].startswith(prefix)]
