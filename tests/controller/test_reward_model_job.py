"""The reward model as a role of its own: a run with ``allocation.reward_model.workers=1`` starts its server worker
(registered as ``reward_model``, answering /health), and a reward-model worker lost mid-run (stopped whole, as a node
that no longer answers looks to the controller) fails the run within 30 s naming the role, leaving no process
behind. A reward-model server that dies is tests/slurm/test_reward_model_on_slurm.py's case."""

import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from hpcrl.launch.registry import Registry
from tests.conftest import REPO
from tests.controller.test_job import processes_of, wait_for_steps

pytestmark = pytest.mark.slow


def test_a_reward_model_server_serves_and_a_lost_one_fails_the_run_naming_it(tmp_path, tiny_model):
    # reward.fn stays mod10: the point is the role, launched, watched and ended like the others
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", "run.trial=t", "run.max_steps=200"]
    cmd += ["eval.stop_at_accuracy=0", "rollout.prompts_per_step=4", "allocation.trainer.workers=1"]
    cmd += ["allocation.reward_model.workers=1", f"reward.model.path={tiny_model}", "cluster.worker_lease_s=5"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "default" / "t"
    try:
        wait_for_steps(proc, run_dir, 1)
        (entry,) = Registry(run_dir / "registry").entries("reward_model")
        with urllib.request.urlopen(f"http://{entry.address}/health", timeout=10) as health:
            assert health.status == 200
        served = (run_dir / "logs" / "reward_model-proc-0.log").read_text()
        assert str(tiny_model) in served, "its server serves reward.model.path"
        server_entry = Registry(run_dir / "registry").entries("server")[0]
        assert entry.address != server_entry.address, "a port slot of its own"
        # the worker and its server stop answering: the lease keeper loses it, and the run fails naming it
        killed = time.monotonic()
        worker = psutil.Process(entry.pid)
        for process in [worker, *worker.children(recursive=True)]:
            process.send_signal(signal.SIGSTOP)
        _, stderr = proc.communicate(timeout=90)
        took_s = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr[-3000:]
    assert "reward_model worker 0 on node" in stderr and "has not answered the controller" in stderr, stderr[-3000:]
    assert took_s < 30, f"the run took {took_s:.1f} s to fail"
    assert not processes_of(str(run_dir)), "no process of the run outlives it"


def test_evaluation_only_starts_the_reward_models_servers_too(tmp_path, tiny_model):
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", "run.trial=t", "run.max_steps=0"]
    cmd += ["dataset.eval_size=4", "allocation.reward_model.workers=1", f"reward.model.path={tiny_model}"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "default" / "t"
    assert "ready: serving at" in (run_dir / "logs" / "reward_model-0.log").read_text()
    assert not processes_of(str(run_dir)), "no process of the run outlives it"
