"""A controller for the signal tests: starts a plain role and a torchrun role through SlurmScheduler (one job
each), prints one JSON line with their job ids once every worker is ready, then waits to be signalled.

    python slurm_controller.py RUN_ROOT PARTITION JOB_PREFIX
"""

import json
import signal
import sys
import time
from pathlib import Path

from hpcrl.config.schema import ClusterConfig
from hpcrl.launch.base import RoleSpec
from hpcrl.launch.slots import PortSlots
from hpcrl.launch.slurm import SlurmScheduler
from hpcrl.rundir import RunDir

signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the test runner ignores SIGINT
root, partition, job_prefix = sys.argv[1:]
run_dir = RunDir.create(root, "exp", "trial")
worker = [sys.executable, str(Path(__file__).resolve().parents[2] / "launch" / "scripts" / "rank_worker.py")]
cluster = ClusterConfig(kind="slurm", partition=partition, time_min=5, submit_mode="per_role")
slots = PortSlots({"plain": 1, "ranks": 1}, rendezvous=("ranks",))
with SlurmScheduler(run_dir, slots, cluster, job_prefix=job_prefix, cache_s=1.0, stop_timeout_s=30) as scheduler:
    plain = scheduler.start(RoleSpec("plain", worker, workers=1, setup_timeout_s=60))
    ranks = scheduler.start(RoleSpec("ranks", worker, workers=1, torchrun=True, setup_timeout_s=60))
    plain.wait_ready()
    ranks.wait_ready()
    print(json.dumps(scheduler.job_ids), flush=True)
    while True:
        plain.check_alive()
        ranks.check_alive()
        time.sleep(0.2)
