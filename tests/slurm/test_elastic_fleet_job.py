"""An elastic server fleet on the test cluster whose nodes are hosts (``allocation.server.min_workers``), in one run:
a server node's link cut mid-run (the run goes on with the other server, names the node, and a replacement job
joins and serves), a server the user adds from outside (``python -m hpcrl.inference.join RUN_DIR``: it answers
with the run's current weights), and a server job Slurm requeues (it comes back and rejoins). No group fails on
the way, and ending the run leaves no job in the queue and no joined server running."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpcrl.launch.registry import Registry
from tests.conftest import REPO
from tests.slurm.test_faults_on_nodes import SLURMD_TIMEOUT_S, cut, start, steps, wait_for_steps, wait_gone, wait_idle

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# each server and the trainers on a node of their own (4 nodes: two servers, the trainers, the replacement), so
# that the cut takes one server and nothing else; servers may be requeued
FLEET = [
    "cluster.submit_mode=per_role",
    "allocation.server.workers=2",
    "allocation.server.min_workers=1",
    "inference.on_server_exit=restart",
    "cluster.roles.server.extra_sbatch=[--requeue,--exclusive]",
    "cluster.roles.trainer.extra_sbatch=[--exclusive]",
    "run.max_steps=1000",  # the test ends the run once it has seen everything
]


def controller_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "controller-0.log").read_text()


def wait_for_log(proc: subprocess.Popen, run_dir: Path, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while (found := re.search(pattern, controller_log(run_dir))) is None:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {pattern!r} in the controller's log within {timeout_s} s"
        time.sleep(0.5)
    return found


def first_answer(proc: subprocess.Popen, run_dir: Path, address: str, after: int, timeout_s: float = 60) -> int:
    """The weight version of ``address``'s first answer logged past offset ``after`` of the controller's log."""
    deadline = time.monotonic() + timeout_s
    pattern = rf"first answer from server {re.escape(address)}: weight version (\d+)"
    while (found := re.search(pattern, controller_log(run_dir)[after:])) is None:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{address} answered no request within {timeout_s} s"
        time.sleep(0.5)
    return int(found[1])


def server_job(run_dir: Path, rank: int) -> str:
    """The Slurm job that runs server ``rank`` (the first of its jobs: the test requeues one never replaced)."""
    return re.findall(rf"server-{rank}: submitted Slurm job (\d+)", controller_log(run_dir))[0]


def test_elastic_fleet_on_slurm_replaces_a_cut_server_takes_a_joined_one_and_a_requeued_one_rejoins(
    slurm_cluster, job_prefix, tmp_path
):
    proc, run_dir = start(tmp_path, job_prefix, "fleet", *FLEET)
    node, joiner = None, None
    try:
        wait_for_steps(proc, run_dir, 2)
        servers = {e.rank: e for e in Registry(run_dir / "registry").entries("server")}
        node = servers[1].node
        subprocess.run(cut(node), check=True)
        cut_at, steps_at_cut, logged_at_cut = time.monotonic(), len(steps(run_dir)), len(controller_log(run_dir))
        wait_for_log(proc, run_dir, rf"server worker 1 .*{node}", 60)
        wait_for_steps(proc, run_dir, steps_at_cut + 2, timeout_s=60 - (time.monotonic() - cut_at))
        print(f"the run went on {time.monotonic() - cut_at:.0f} s after the cut")
        back = wait_for_log(proc, run_dir, r"server worker 1 is back in the pool at (\S+) with weights version", 180)
        assert first_answer(proc, run_dir, back[1], logged_at_cut) >= 2

        joiner = subprocess.Popen(
            [sys.executable, "-m", "hpcrl.inference.join", str(run_dir)], cwd=REPO, start_new_session=True
        )
        pattern = r"server worker (\d+) joined the run from node \S+ at (\S+) with weights version (\d+)"
        joined = wait_for_log(proc, run_dir, pattern, 120)
        assert int(joined[1]) >= 2, "a joined server takes a rank the run's own servers do not use"
        version = first_answer(proc, run_dir, joined[2], 0)
        assert version >= int(joined[3]) >= 2, "it answers with the run's weights, never the initial ones"

        job, requeued_at = server_job(run_dir, 0), len(controller_log(run_dir))
        subprocess.run(["scontrol", "requeue", job], check=True)
        wait_for_log(proc, run_dir, r"server worker 0 leaves the pool until it registers again", 60)
        # Slurm holds a requeued job for 2 minutes (BeginTime); an admin may release it, and the test does
        subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)
        rejoined = wait_for_log(proc, run_dir, r"server worker 0 is back in the pool at (\S+)", 120)
        assert first_answer(proc, run_dir, rejoined[1], requeued_at) >= 2

        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
        assert joiner.wait(60) is not None, "the joined server ends with the controller's lease"
        wait_gone(re.findall(r"Slurm job (\d+)", controller_log(run_dir)), SLURMD_TIMEOUT_S + 60)
    finally:
        if node is not None:
            subprocess.run([*cut(node)[:-1], "up"], check=False)
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        for leftover in (proc, joiner):
            if leftover is not None and leftover.poll() is None:
                os.killpg(leftover.pid, signal.SIGKILL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "every step once"
    assert sum(r.get("groups_failed", 0) for r in rows) == 0, "no group lost a request to the cut or the requeue"
    assert (rows[-1]["servers_restarted"], rows[-1]["servers_joined"]) == (1, 1), rows[-1]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    wait_idle(slurm_cluster.nodes, 120)  # the node back on the network and resumed, for the tests after this one
