"""The reward model's servers on the real test Slurm: a job of its own under ``per_role``, a component of its own
in the workers' heterogeneous job; every process of it on its node killed mid-run (the worker and its inference
server, as a crashed node leaves them) fails the run within 30 s naming the ``reward_model`` role's job, leaving no
job (``no_leftover_jobs``)."""

import time

import psutil
import pytest

from hpcrl.launch.registry import Registry
from tests.controller.test_job import wait_for_steps
from tests.slurm.test_job_failures import FAIL_WITHIN_S, finish, job_named, run_dir_of, start_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["hetjob", "per_role"])
def test_a_reward_model_node_s_processes_killed_mid_run_fail_the_run_naming_its_job(
    slurm_cluster, job_prefix, tmp_path, tiny_model, mode
):
    overrides = ("allocation.reward_model.workers=1", f"reward.model.path={tiny_model}", "run.max_steps=500")
    proc = start_job(
        tmp_path, job_prefix, *overrides, "eval.stop_at_accuracy=0", "rollout.prompts_per_step=4", mode=mode
    )
    run_dir = run_dir_of(tmp_path, job_prefix)
    wait_for_steps(proc, run_dir, 1)
    (entry,) = Registry(run_dir / "registry").entries("reward_model")
    worker = psutil.Process(entry.pid)  # the nodes are network namespaces: their PIDs are this host's
    for process in [worker, *worker.children(recursive=True)]:
        process.kill()
    killed = time.time()
    code, stderr, exited = finish(proc, timeout_s=120)
    job_id = job_named(f"{job_prefix}reward_model")
    assert code == 1, stderr[-3000:]
    if mode == "hetjob":
        assert job_id.endswith("+2"), job_id  # server +0, trainer +1, reward_model +2
    else:
        assert "+" not in job_id, job_id  # a job of its own
    assert f"reward_model worker job {job_id}" in stderr, stderr[-3000:]
    assert exited - killed < FAIL_WITHIN_S, (exited, killed)
