"""Faults that only exist where nodes are hosts of their own, on the test cluster whose nodes are network
namespaces: a controller SIGKILLed while its workers run as Slurm jobs (they end themselves once their lease
runs out, and their jobs leave the queue), and a node cut off from the network mid-run (the run fails within
a bounded time naming the role and the node, every job is cancelled, and a rerun resumes).

The job ids and the nodes are read from the run directory: the controller's log and the workers' registry.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.launch.lease import REGISTRY_SEEN_S
from hpcrl.launch.registry import Registry
from tests.conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LEASE_S = 10  # cluster.worker_lease_s for these runs
SLURMD_TIMEOUT_S = 30  # slurm/dev-cluster.sh: a node that stops answering is DOWN after this


def start(tmp_path: Path, job_prefix: str, trial: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")  # job names: hpcrl-<experiment>-<role>
    cmd = [sys.executable, "-m", "hpcrl.main", "cluster=slurm_local", f"run.root={tmp_path}"]
    cmd += [f"run.experiment={experiment}", f"run.trial={trial}", "eval.stop_at_accuracy=0", "eval.every_steps=0"]
    cmd += ["rollout.prompts_per_step=16", f"cluster.worker_lease_s={LEASE_S}", *overrides]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    return proc, tmp_path / experiment / trial


def steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, count: int, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while len(steps(run_dir)) < count:
        assert proc.poll() is None, proc.communicate()[1][-3000:]  # type: ignore[index]
        assert time.monotonic() < deadline, f"fewer than {count} steps within {timeout_s} s"
        time.sleep(0.3)


def job_ids(run_dir: Path) -> list[str]:
    """The Slurm jobs the controller submitted, from its log."""
    log = (run_dir / "logs" / "controller-0.log").read_text()
    return sorted(set(re.findall(r"submitted (?:heterogeneous )?Slurm job (\d+)", log)))


def queued(ids: list[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"], capture_output=True, text=True)
    return out.stdout.split("\n")[:-1] if out.returncode == 0 else []


def wait_gone(ids: list[str], timeout_s: float) -> float:
    start = time.monotonic()
    while queued(ids):
        if time.monotonic() - start > timeout_s:
            left = queued(ids)
            subprocess.run(["scancel", *ids], check=False)
            pytest.fail(f"Slurm jobs still queued {timeout_s} s on: {left}")
        time.sleep(1)
    return time.monotonic() - start


@pytest.mark.parametrize("mode", ["per_role", "hetjob"])
def test_a_sigkilled_controller_leaves_no_job_in_the_queue_once_the_leases_run_out(
    slurm_cluster, job_prefix, tmp_path, mode
):
    proc, run_dir = start(tmp_path, job_prefix, "killed", f"cluster.submit_mode={mode}", "run.max_steps=200")
    try:
        wait_for_steps(proc, run_dir, 2)
        ids = job_ids(run_dir)
        assert ids and len(queued(ids)) >= 1, ids
        os.killpg(proc.pid, signal.SIGKILL)  # the controller and anything of its own session: no cleanup at all
        proc.wait(10)
        time.sleep(3)
        assert queued(ids), "the worker jobs outlive their controller for a moment"
        # the lease (with the registry's delay, if the controller died before its first renewal), the workers'
        # own shutdown, Slurm's end of the job
        took = wait_gone(ids, REGISTRY_SEEN_S + LEASE_S + 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"{mode}: the worker jobs left the queue {took:.0f} s after the controller was killed")
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "it is gone, so this worker ends" in logs


def cut(node: str) -> list[str]:
    """Take the node's link down, on this host's side of its veth (slurm/dev-cluster.sh: hpcrl-v<K>)."""
    return ["ip", "link", "set", f"hpcrl-v{node.removeprefix('n')}", "down"]


def test_a_node_cut_off_mid_run_fails_the_run_naming_it_cancels_every_job_and_the_rerun_resumes(
    slurm_cluster, job_prefix, tmp_path
):
    overrides = ["cluster.submit_mode=per_role", "checkpoint.every_steps=2"]
    proc, run_dir = start(tmp_path, job_prefix, "cut", *overrides, "run.max_steps=200")
    node = None
    try:
        wait_for_steps(proc, run_dir, 3)
        (rank0,) = [e for e in Registry(run_dir / "registry").entries("trainer") if e.rank == 0]
        node = rank0.node
        subprocess.run(cut(node), check=True)
        cut_at = time.monotonic()
        _, stderr = proc.communicate(timeout=LEASE_S + 90)
        took = time.monotonic() - cut_at
        assert proc.returncode == 1, stderr[-3000:]
        message = re.search(r"trainer worker \d+ on node (\S+) \((\S+)\) has not answered the controller", stderr)
        assert message and message[1] == node, stderr[-3000:]
        report = (run_dir / "hang_report" / "summary.txt").read_text()  # written before the run failed
        assert report.startswith(f"hang report: trainer rank 0 on node {node} ") and "heartbeat" in report, report
        ids = job_ids(run_dir)
        gone_after = wait_gone(ids, SLURMD_TIMEOUT_S + 90)  # the cut node's job goes once Slurm calls it DOWN
    finally:
        if node is not None:
            subprocess.run([*cut(node)[:-1], "up"], check=False)
            # back on the network, a DOWN node returns by itself only when slurmctld next asks it to register,
            # which Slurm 22.05 does every 20 pings (up to 200 s here); an admin resumes it, and so does the test
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"the run failed {took:.0f} s after the cut; its jobs left the queue {gone_after:.0f} s later")
    last = steps(run_dir)[-1]
    wait_idle(slurm_cluster.nodes, 120)  # the node back on the network and resumed, idle again
    rerun = [sys.executable, "-m", "hpcrl.main", "cluster=slurm_local", f"run.root={tmp_path}", "run.trial=cut"]
    rerun += [f"run.experiment={run_dir.parent.name}", "cluster.submit_mode=per_role", "recover.mode=auto"]
    rerun += [
        "eval.stop_at_accuracy=0",
        "eval.every_steps=0",
        "rollout.prompts_per_step=16",
        f"run.max_steps={last + 2}",
    ]
    result = subprocess.run(rerun, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == last + 2 and 2 <= summary["resumed_from_step"] <= last, summary
    assert steps(run_dir) == list(range(1, last + 3)), "every step once"


def wait_idle(nodes: tuple[str, ...], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        if all(states.get(n) == "idle" for n in nodes):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the nodes are not idle again after {timeout_s} s: {states}")
        time.sleep(1)


HANG_S = 20  # cluster.hang_timeout_s of the hang report's run


def test_hang_report_of_a_sigstopped_trainer_rank_on_slurm_names_its_node_and_leaves_no_job(
    slurm_cluster, job_prefix, tmp_path
):
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")
    run_dir = tmp_path / experiment / "hang"
    cmd = [sys.executable, "-m", "hpcrl.main", "cluster=slurm_local", f"run.root={tmp_path}", "run.trial=hang"]
    cmd += [f"run.experiment={experiment}", "eval.stop_at_accuracy=0", "eval.every_steps=0", "run.max_steps=200"]
    # a lease longer than the hang timeout: the stopped rank's lease endpoint would otherwise name it first
    cmd += ["allocation.trainer.workers=2", f"cluster.hang_timeout_s={HANG_S}", "cluster.worker_lease_s=120"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank1 = None
    try:
        wait_for_steps(proc, run_dir, 1)
        (rank1,) = [e for e in Registry(run_dir / "registry").entries("trainer") if e.rank == 1]
        os.kill(rank1.pid, signal.SIGSTOP)  # the test cluster's nodes share this host's PIDs
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=HANG_S + 90)
        took = time.monotonic() - stopped
        ids = job_ids(run_dir)
        gone_after = wait_gone(ids, 60)
    finally:
        if rank1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1.pid, signal.SIGCONT)
                os.kill(rank1.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    named = f"trainer rank 1 on node {rank1.node} (pid {rank1.pid}) did not answer"
    summary = run_dir / "hang_report" / "summary.txt"
    assert f"{named} " in stderr and str(summary) in stderr, stderr[-3000:]
    text = summary.read_text()
    assert text.startswith(f"hang report: {named} "), text
    spied = "stacks/trainer-1.txt (read by py-spy (dump --nonblocking) on its node, through srun"
    assert f"pid {rank1.pid}  address {rank1.address}: {spied}" in text, text
    # py-spy's frames, "    <function> (<file>:<line>)", run on the stopped rank's node inside its job
    stopped_stacks = (run_dir / "hang_report" / "stacks" / "trainer-1.txt").read_text()
    assert stopped_stacks.startswith(f"Process {rank1.pid}: "), stopped_stacks[:500]
    assert re.search(r"^ {4}\S+ \(\S*hpcrl/\S+\.py:\d+\)$", stopped_stacks, re.MULTILINE), stopped_stacks[:2000]
    (rank0,) = [e for e in Registry(run_dir / "registry").entries("trainer") if e.rank == 0]
    own = (run_dir / "hang_report" / "stacks" / "trainer-0.txt").read_text()
    assert own.startswith(f"pid {rank0.pid} on {rank0.node}") and 'File "' in own, own[:500]
    print(f"the run failed {took:.0f} s after rank 1 stopped; its jobs left the queue {gone_after:.0f} s later")
