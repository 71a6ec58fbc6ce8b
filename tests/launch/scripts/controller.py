"""A controller for the signal tests: starts a plain role and a torchrun role through LocalScheduler,
prints one JSON line with their registry entries once both are ready, then waits to be signalled.

    python controller.py RUN_DIR
"""

import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from hpcrl.launch.base import RoleSpec
from hpcrl.launch.local import LocalScheduler
from hpcrl.launch.slots import PortSlots
from hpcrl.rundir import RunDir

signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the test runner ignores SIGINT
run_dir = RunDir.create(sys.argv[1], "exp", "trial")
worker = [sys.executable, str(Path(__file__).with_name("rank_worker.py"))]
env = {"RANK_WORKER_GRANDCHILD": "1"}
with LocalScheduler(run_dir, PortSlots({"plain": 2, "ranks": 2}), grace_s=2.0) as scheduler:
    plain = scheduler.start(RoleSpec("plain", worker, workers=2, env=env, setup_timeout_s=60))
    ranks = scheduler.start(RoleSpec("ranks", worker, workers=2, torchrun=True, env=env, setup_timeout_s=60))
    entries = plain.wait_ready() + ranks.wait_ready()
    print(json.dumps([asdict(e) for e in entries]), flush=True)
    while True:
        plain.check_alive()
        ranks.check_alive()
        time.sleep(0.2)
