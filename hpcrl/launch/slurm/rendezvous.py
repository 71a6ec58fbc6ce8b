"""The c10d rendezvous of a torchrun role whose step spans nodes, with its port chosen on the node that hosts it.

A port free on the controller's host says nothing about a compute node, so the controller picks none:

    first node of the step:  port = a free port of the role's rendezvous slot (``PortSlots.rendezvous``),
                             probed on this node; published in ``<run_dir>/registry/<role>.rendezvous.json``
                             with the step's key; torchrun then hosts the store on it
    every other node:        waits (up to the role's setup timeout) until that file names this step,
                             then dials the first node at that port

The key is the job, step and restart count, so a file left by an earlier step or a requeued job's
first attempt is never read as this step's. The file is written atomically on the run directory's
shared filesystem, as the registry's entries are.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcrl.net import PortAllocator
from hpcrl.rundir import write_atomic


@dataclass(frozen=True)
class RendezvousPlan:
    """Where a torchrun role's rendezvous port comes from; decided by the controller, used on the nodes."""

    slot: int  # the role's rendezvous port slot
    world: int  # slots in the run's port range
    port_range: tuple[int, int] | None  # cluster.net's range (None: the default)
    file: Path  # <run_dir>/registry/<role>.rendezvous.json
    timeout_s: float  # how long the other nodes wait for the first to publish its port


def step_key(environ: Mapping[str, str]) -> str:
    """This step's key: ``<job>.<step>.<restart>`` (a requeued job restarts its step ids)."""
    return ".".join(environ.get(name, "0") for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"))


def rendezvous_port(plan: RendezvousPlan, key: str, first_node: bool, poll_s: float = 0.2) -> int:
    """The first node picks and publishes the port; every other node reads it (TimeoutError past the deadline)."""
    if first_node:
        port = PortAllocator(plan.port_range, rank=plan.slot, world_size=plan.world).allocate(1)[0]
        write_atomic(plan.file, json.dumps({"key": key, "host": socket.gethostname(), "port": port}))
        return port
    deadline = time.monotonic() + plan.timeout_s
    while True:
        published = _read(plan.file)
        if published.get("key") == key:
            return int(published["port"])
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the first node of step {key} did not publish its torchrun rendezvous port in {plan.file} "
                f"within {plan.timeout_s:g} s (found {published or 'nothing'}); see that node's output in the job files"
            )
        time.sleep(poll_s)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet (a shared filesystem may show it late)
        return {}
