"""One worker of the launch tests: listens on a port from its own slot, registers, then sleeps.

Environment (besides what the scheduler sets):
  RANK_WORKER_EXIT=<code>        exit with <code> at start instead of registering...
  RANK_WORKER_EXIT_RANK=<rank>   ...only on that rank (default: every rank)
  RANK_WORKER_NEVER_READY=1      listen but never register
  RANK_WORKER_GRANDCHILD=1       start a child process (a `sleep`) first, to test that trees are ended
"""

import errno
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slots import worker_ports
from hpcrl.net import discover_host

rank = int(os.environ["HPCRL_RANK"])
print(f"rank {rank} starting (pid {os.getpid()})", flush=True)
code = os.environ.get("RANK_WORKER_EXIT")
if code is not None and os.environ.get("RANK_WORKER_EXIT_RANK", str(rank)) == str(rank):
    print(f"rank {rank}: told to exit with {code}", file=sys.stderr, flush=True)
    sys.exit(int(code))

extra = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "HPCRL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
if os.environ.get("RANK_WORKER_GRANDCHILD"):
    extra["grandchild"] = subprocess.Popen(["sleep", "120"]).pid

listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
# a port probed free may be taken before the bind (tests in other xdist workers): retry, as workers do
for attempt in range(5):
    port = worker_ports().allocate(1)[0]
    try:
        listener.bind(("0.0.0.0", port))  # every interface; it advertises this node's own address, as workers do
        break
    except OSError as e:
        if e.errno != errno.EADDRINUSE or attempt == 4:
            raise
listener.listen(16)
if not os.environ.get("RANK_WORKER_NEVER_READY"):
    registry = Registry(Path(os.environ["HPCRL_RUN_DIR"]) / "registry")
    registry.register(Entry(os.environ["HPCRL_ROLE"], rank, discover_host("ipv4"), port, extra=extra))
print(f"rank {rank} listening on {port}", flush=True)
time.sleep(120)
