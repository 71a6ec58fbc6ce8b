"""A server that dies mid-run leaves the pool (``inference.on_server_exit=drop``) and the run goes on with the
others; with ``restart`` it comes back with the current weights; with ``fail`` the run fails naming the server."""

import re
import subprocess
import sys

import psutil
import pytest

from hpcrl.launch.registry import Registry
from tests.conftest import REPO
from tests.controller.test_job import metrics_of, processes_of, wait_for_steps

pytestmark = pytest.mark.slow

RUN = ["run.trial=t", "eval.stop_at_accuracy=0", "rollout.prompts_per_step=8"]


def kill_a_server_after_two_steps(
    tmp_path, *overrides: str, servers: int = 2
) -> tuple[subprocess.CompletedProcess, object]:
    """Run a job with ``servers`` servers and kill the inference server of the last one after step 2."""
    rank = servers - 1
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", *RUN, f"allocation.server.workers={servers}"]
    cmd += overrides
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "default" / "t"
    wait_for_steps(proc, run_dir, 2)
    (worker,) = [e for e in Registry(run_dir / "registry").entries("server") if e.rank == rank]
    # the inference server itself crashes; its worker notices and exits
    for server in psutil.Process(worker.pid).children(recursive=True):
        server.kill()
    stdout, stderr = proc.communicate(timeout=420)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), run_dir


def test_a_dead_server_leaves_the_pool_and_the_run_goes_on(tmp_path):
    result, run_dir = kill_a_server_after_two_steps(tmp_path, "run.max_steps=8")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["servers_lost"] == 1
    assert "server worker 1" in (run_dir / "logs" / "controller-0.log").read_text()
    assert not processes_of(str(run_dir)), "no process of the run outlives it"


def test_with_on_server_exit_fail_a_dead_server_fails_the_run(tmp_path):
    result, run_dir = kill_a_server_after_two_steps(tmp_path, "run.max_steps=200", "inference.on_server_exit=fail")
    assert result.returncode == 1
    assert "server worker 1" in result.stderr, result.stderr[-3000:]
    assert not processes_of(str(run_dir)), "no process of the run outlives it"


def weights_loaded_after_restart(run_dir, rank: int) -> list[int]:
    """The weight versions server ``rank`` loaded from the run's exports after its worker's second start."""
    log = (run_dir / "logs" / f"server-proc-{rank}.log").read_text()
    starts = log.split(f"--- hpcrl: starting server {rank}")
    assert len(starts) == 3, f"server {rank} should have started twice:\n{log[-3000:]}"
    return [int(v) for v in re.findall(r"loaded weights version (\d+) from \S*/weights/v", starts[2])]


def check_restarted_with_the_current_weights(run_dir, rank: int, steps: int) -> None:
    rows = metrics_of(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert (rows[-1]["servers_restarted"], rows[-1]["servers_lost"]) == (1, 0)
    log = (run_dir / "logs" / "controller-0.log").read_text()
    back = re.search(rf"server worker {rank} is back in the pool at \S+ with weights version (\d+)", log)
    assert back, log[-3000:]
    loaded = weights_loaded_after_restart(run_dir, rank)
    assert loaded[0] == int(back[1]) >= 2, "it first loads the weights the others hold"
    assert loaded[-1] == steps, "then every later weight sync"
    assert not processes_of(str(run_dir)), "no process of the run outlives it"


def test_with_restart_the_only_server_comes_back_with_the_current_weights(tmp_path):
    # the rollout waits for it; one of two coming back is tested with rollout workers below
    result, run_dir = kill_a_server_after_two_steps(
        tmp_path, "run.max_steps=8", "inference.on_server_exit=restart", servers=1
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_restarted_with_the_current_weights(run_dir, 0, 8)


def test_past_max_restarts_a_dead_server_fails_the_run(tmp_path):
    overrides = ("run.max_steps=200", "inference.on_server_exit=restart", "inference.max_restarts=0")
    result, run_dir = kill_a_server_after_two_steps(tmp_path, *overrides)
    assert result.returncode == 1
    assert "server worker 1" in result.stderr and "inference.max_restarts=0" in result.stderr, result.stderr[-3000:]
    assert not processes_of(str(run_dir)), "no process of the run outlives it"


def test_with_restart_one_of_two_servers_comes_back_with_the_current_weights_and_rollout_workers_are_told(tmp_path):
    # a server starts in about 10 s, and up to 20 s on a loaded machine, where a step takes 0.4 s: the run must
    # outlast the restart
    overrides = ("run.max_steps=80", "inference.on_server_exit=restart", "rollout.workers=1")
    result, run_dir = kill_a_server_after_two_steps(tmp_path, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    check_restarted_with_the_current_weights(run_dir, 1, 80)
    controller_log = (run_dir / "logs" / "controller-0.log").read_text()
    back = re.search(r"server worker 1 is back in the pool at (\S+)", controller_log)
    assert back
    pools = re.findall(r"inference servers now: (.*) \(were", (run_dir / "logs" / "rollout-0.log").read_text())
    assert len(pools[0].split(", ")) == 1, "first the dead server leaves the worker's pool"
    assert back[1] in pools[-1].split(", ") and len(pools[-1].split(", ")) == 2, "then the restarted one joins"
