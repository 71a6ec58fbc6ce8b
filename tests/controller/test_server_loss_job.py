"""A server that dies mid-run leaves the pool (``inference.on_server_exit=drop``) and the run goes on with the
others; with ``fail`` the run fails naming the server."""

import subprocess
import sys

import psutil
import pytest

from hpcrl.launch.registry import Registry
from tests.conftest import REPO
from tests.controller.test_job import metrics_of, processes_of, wait_for_steps

pytestmark = pytest.mark.slow

RUN = ["run.trial=t", "eval.stop_at_accuracy=0", "rollout.prompts_per_step=8", "allocation.server.workers=2"]


def kill_a_server_after_two_steps(tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, object]:
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", *RUN, *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "default" / "t"
    wait_for_steps(proc, run_dir, 2)
    (worker,) = [e for e in Registry(run_dir / "registry").entries("server") if e.rank == 1]
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
