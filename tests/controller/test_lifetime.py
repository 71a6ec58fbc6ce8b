"""No process outlives its run, and every signal ends it in bounded time: the default job on this machine, its
controller SIGKILLed right after its first step (its workers end themselves when their lease runs out, a lease
after it) or SIGTERMed while it waits on something that will not come (it ends within 30 s, with every process of
the run).

Before, a SIGKILLed controller left the inference server and the torchrun trainers running for good, and a
busy one went on for minutes after SIGTERM; then, killed before its heartbeat had reached a worker it had
already called, it left that worker running for the registry's delay (60 s) on top of the lease.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO
from tests.controller.test_job import processes_of, wait_for_steps

LEASE_S = 6  # cluster.worker_lease_s for these runs
LEASE_ENDS_WITHIN_S = LEASE_S + 10  # what a SIGKILLed controller's workers are promised: the lease, then their exit
ENDS_WITHIN_S = 30  # what a signalled run is promised


def start(tmp_path: Path, trial: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", f"run.trial={trial}", "run.max_steps=200"]
    cmd += ["eval.stop_at_accuracy=0", "eval.every_steps=0", f"cluster.worker_lease_s={LEASE_S}", *overrides]
    env = {**os.environ, "HPCRL_TEST_FLAG": str(tmp_path / "flag")}  # tests/controller/rewards.py reads it
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    return proc, tmp_path / "default" / trial


def the_run(proc: subprocess.Popen, run_dir: Path) -> list[psutil.Process]:
    """Every process of the run: the controller's descendants, and whatever names its run directory."""
    procs = {p.pid: p for p in processes_of(str(run_dir))}
    procs.update((p.pid, p) for p in psutil.Process(proc.pid).children(recursive=True))
    return list(procs.values())


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def wait_all_gone(procs: list[psutil.Process], timeout_s: float) -> float:
    """Seconds until every process has ended; fails past the deadline, naming who is left."""
    start = time.monotonic()
    while alive(procs):
        if time.monotonic() - start > timeout_s:
            left = [(p.pid, " ".join(p.cmdline()[:4])) for p in alive(procs)]
            for p in alive(procs):
                p.kill()
            pytest.fail(f"still running {timeout_s} s on: {left}")
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.mark.slow
def test_a_sigkilled_controller_leaves_nothing_running_once_the_leases_run_out(tmp_path):
    proc, run_dir = start(tmp_path, "killed", "rollout.workers=1")
    try:
        wait_for_steps(proc, run_dir, 1)  # its workers called, perhaps not yet renewed
        procs = the_run(proc, run_dir)
        roles = {p.environ().get("HPCRL_ROLE") for p in procs if p.is_running()}
        assert {"server", "trainer", "rollout"} <= roles, roles
        os.kill(proc.pid, signal.SIGKILL)  # as the OOM killer would: no cleanup of its own
        killed = time.monotonic()
        proc.wait(10)
        time.sleep(2)
        assert alive(procs), "the workers outlive their controller for a moment (their lease has not run out)"
        wait_all_gone(procs, LEASE_ENDS_WITHIN_S - (time.monotonic() - killed))
        took = time.monotonic() - killed
    finally:
        for p in alive(the_run(proc, run_dir) if proc.poll() is None else []):
            p.kill()
    assert took > LEASE_S - 3, f"gone after {took:.1f} s: by their lease, not by the kill itself"
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "no word from controller" in logs and "it is gone, so this worker ends" in logs


def sigstop(run_dir: Path, role: str) -> list[psutil.Process]:
    """Freeze the role's processes (a hung server or trainer): they take no request and no signal but SIGKILL."""
    procs = [p for p in processes_of(str(run_dir)) if p.environ().get("HPCRL_ROLE") == role]
    if role == "server":  # the worker's own child: the server process that answers the HTTP requests
        procs += [c for p in procs for c in p.children(recursive=True)]
    for p in procs:
        p.suspend()
    return procs


def raise_flag(run_dir: Path) -> None:
    """From now on the test's rewards (tests/controller/rewards.py) turn slow, or raise."""
    (run_dir.parent.parent / "flag").touch()


BUSY = {
    # the controller waits on generation from a server that takes requests and never answers
    "generation": ([], lambda run_dir: sigstop(run_dir, "server")),
    # it waits on a train step (or the weight sync after it) from trainers that never answer
    "training": ([], lambda run_dir: sigstop(run_dir, "trainer")),
    # it waits on reward processes busy for minutes
    "slow reward": (["reward.fn=tests.controller.rewards:mod10_then_slow", "reward.timeout_s=600"], raise_flag),
    # it keeps starting episodes whose groups are all rejected: a batch that never fills
    "batch never fills": (
        ["reward.fn=tests.controller.rewards:raises_after_flag", "rollout.max_rejected_in_a_row=1000000"],
        raise_flag,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("state", list(BUSY))
def test_sigterm_ends_a_busy_controller_within_30_s_with_every_process_of_the_run(tmp_path, state):
    overrides, freeze = BUSY[state]
    trial = state.replace(" ", "-")
    proc, run_dir = start(tmp_path, trial, "reward.workers=2", *overrides)
    try:
        wait_for_steps(proc, run_dir, 2)
        freeze(run_dir)
        time.sleep(4)  # the controller is now waiting on it
        assert proc.poll() is None
        procs = the_run(proc, run_dir)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{state}: the controller still runs {ENDS_WITHIN_S} s after SIGTERM")
        took = time.monotonic() - signalled
        wait_all_gone(procs, 5)  # its processes went with it, or right after
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in alive(processes_of(str(run_dir))):
            p.kill()
    assert code == 128 + signal.SIGTERM, (code, proc.stderr.read()[-3000:])
    print(f"{state}: ended {took:.1f} s after SIGTERM")
