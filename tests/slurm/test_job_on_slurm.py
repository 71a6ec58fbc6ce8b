"""The default tiny job with its workers on the real test Slurm, whose nodes are hosts of their own: both submit
modes, both weight syncs, PPO with its critic (algorithm=ppo: in the heterogeneous job the critic is its third
component, under per_role a job of its own whose two ranks span two nodes), and a run whose own traffic is IPv6
only, whose rollout workers (a third component) run a plug-in agent from a module outside the package (its
proxy on each node's ``::1``). With ``train.weight_sync=distributed`` the servers join a process group hosted by
trainer rank 0 on its node, at a port chosen there: the log line names that node's address."""

import ipaddress
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.launch.registry import Registry
from hpcrl.launch.slurm.task import expand_hostlist
from tests.conftest import REPO
from tests.controller.test_agent_job import GROUP, plugin_overrides

NODES = ipaddress.ip_network("198.51.100.0/24")
HOST = ipaddress.ip_address("198.51.100.1")  # this machine on the test cluster's network: never a worker's


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "sync", "family", "algorithm"),
    # each mode, weight sync and algorithm at least once; PPO's critic as a hetjob component runs in
    # tests/slurm/test_job_failures.py (its rank killed), and per_role jobs with a disk sync and a server per job in
    # tests/slurm/test_elastic_fleet_job.py, so the hetjob-disk-ppo and per_role-distributed-grpo runs are gone
    [("per_role", "disk", "auto", "ppo"), ("hetjob", "distributed", "ipv6", "grpo")],
)  # fmt: skip
def test_tiny_job_runs_its_workers_as_slurm_jobs(slurm_cluster, job_prefix, tmp_path, mode, sync, family, algorithm):
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")  # job names: hpcrl-<experiment>-<role>...
    cmd = [sys.executable, "-m", "hpcrl.main", "cluster=slurm_local", f"cluster.submit_mode={mode}"]
    cmd += [f"run.root={tmp_path}", f"run.experiment={experiment}", "run.trial=t", "run.max_steps=3"]
    cmd += ["eval.stop_at_accuracy=0", "rollout.prompts_per_step=16", f"train.weight_sync={sync}"]
    cmd += [f"cluster.net.family={family}", f"algorithm={algorithm}"]
    if algorithm == "ppo" and mode == "per_role":  # the critic's ranks span two nodes, as the trainer's may
        cmd += ["allocation.critic.workers=2", "allocation.critic.nodes=2"]
    elif mode == "hetjob" and algorithm != "ppo":  # with rollout workers: a third component (the critic is one)
        cmd += ["rollout.workers=2", "reward.workers=1"]
    env = dict(os.environ)
    if family == "ipv6":  # the rollout workers import a user's agent, found on PYTHONPATH only
        cmd += plugin_overrides(tmp_path)
        env["PYTHONPATH"] = str(tmp_path / "outside")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and "eval_accuracy_after" in summary
    jobs = {name.removeprefix(job_prefix): job_id for job_id, name, _ in _jobs_named(job_prefix)}
    third = "critic" if algorithm == "ppo" else "rollout"
    if mode == "hetjob":  # one job whose components are the roles
        assert {role: i.rsplit("+", 1)[-1] for role, i in jobs.items()} == {"server": "0", "trainer": "1", third: "2"}
    else:  # one job per role
        roles = {"server", "trainer"} | ({"critic"} if algorithm == "ppo" else set())
        assert set(jobs) == roles and not any("+" in i for i in jobs.values()), jobs
    run_dir = tmp_path / experiment / "t"
    check_addresses(run_dir, family)
    if algorithm == "ppo":
        check_critic(run_dir, summary, jobs["critic"], nodes=2 if mode == "per_role" else 1)
    if sync == "distributed":
        check_group_on_trainer_node(run_dir)
    if family == "ipv6":  # every episode ran the plug-in: two completions each
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert all(r["agent_completions"] == 2 * 16 * GROUP for r in rows), rows


def check_critic(run_dir: Path, summary: dict, job_id: str, nodes: int) -> None:
    """The critic's ranks ran in their job (or component) on that many nodes, trained at every step, and the run
    exported the trained critic."""
    cmd = ["sacct", "-X", "-n", "-P", "-o", "JobID,NodeList", "-j", job_id.split("+")[0]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    node_list = dict(line.split("|") for line in out.splitlines())[job_id]
    critics = Registry(run_dir / "registry").entries("critic")
    assert len(expand_hostlist(node_list)) == nodes and len({e.node for e in critics}) == nodes, (node_list, critics)
    assert set(expand_hostlist(node_list)) == {e.node for e in critics}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the critic's update on every step: a finite loss, its explained variance in (-inf, 1]
        assert math.isfinite(r["critic_loss"]) and r["critic_loss"] > 0 and r["critic_explained_var"] <= 1, r
    assert (Path(summary["final_critic"]) / "config.json").is_file(), summary


def check_addresses(run_dir: Path, family: str) -> None:
    """Every worker advertised its own node's address, of the family asked for."""
    registry = Registry(run_dir / "registry")
    entries = [e for role in ("server", "trainer", "critic", "rollout") for e in registry.entries(role)]
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
