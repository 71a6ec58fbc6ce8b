"""``RUN_DIR/controller-lease.json``: the running controller of a run, for a worker that joins it from outside.

The controller writes it as it starts, before any worker (``controller/job.py``), atomically; a rerun that resumes
the run writes its own over it (a checkpoint's ``controller.json`` is another thing: the loop's state). A server
a user adds to the running run (``python -m hpcrl.inference.join``) reads it for what a scheduler would have
handed it:

    controller   the controller's id: the joined worker holds its lease on it (``lease.py``), as every other
                 worker does, and so ends when this controller is gone (a renewal from another one does not count)
    lease_s      cluster.worker_lease_s of the run
    pid, host    the controller's process and node (``socket.gethostname()``), started: its start time
                 (psutil's create_time), so that a pid the kernel reused is not taken for the controller
    slots        the run's port slots (``PortSlots``: its counts and rendezvous roles): the joined worker draws
                 its ports from one of the run's slices, as the run's own workers do

Whether the controller is still alive can be told only on its own node (``ControllerFile.alive``); elsewhere the
lease settles it: a worker joined to a controller that is gone hears no renewal and ends.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from hpcrl.launch.slots import PortSlots
from hpcrl.rundir import write_atomic

FILE = "controller-lease.json"
_SAME_START_S = 0.01  # start times within a clock tick (psutil reads them in 1/100 s) name the same process


@dataclass(frozen=True)
class ControllerFile:
    controller: str  # the controller's id (HPCRL_CONTROLLER_ID of its workers)
    lease_s: float  # seconds a worker lives without the controller's heartbeat (cluster.worker_lease_s)
    pid: int  # the controller's process, on host
    host: str  # the controller's node, as socket.gethostname() names it
    started: float  # the process's start time (psutil create_time, seconds since the epoch)
    slot_counts: dict[str, int]  # PortSlots's counts: workers of each role that listens
    rendezvous: list[str]  # PortSlots's rendezvous roles

    @property
    def slots(self) -> PortSlots:
        """The run's port slots, as the controller built them."""
        return PortSlots(self.slot_counts, rendezvous=self.rendezvous)

    def alive(self) -> bool | None:
        """Whether the controller's process still runs: None on another node, where this cannot be told."""
        if self.host != socket.gethostname():
            return None
        return process_runs(self.pid, self.started)


def controller_file(run_dir: Path) -> Path:
    return Path(run_dir) / FILE


def write_controller_file(
    run_dir: Path, controller: str, lease_s: float, slots: PortSlots, pid: int | None = None, host: str | None = None
) -> Path:
    """Publish the controller (by default this process on this node) of the run in ``run_dir``."""
    pid = os.getpid() if pid is None else pid
    started = process_started(pid)
    if started is None:
        raise ValueError(f"process {pid} does not run: it cannot be the run's controller")
    found = ControllerFile(
        controller,
        float(lease_s),
        pid,
        host or socket.gethostname(),
        started,
        dict(slots.counts),
        list(slots.rendezvous_roles),
    )
    path = controller_file(run_dir)
    write_atomic(path, json.dumps(asdict(found), indent=1) + "\n")
    return path


def read_controller_file(run_dir: Path) -> ControllerFile | None:
    """The run's controller file; None when there is none. ``ValueError`` naming the file when it is not one."""
    path = controller_file(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return ControllerFile(**json.loads(text))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a controller file ({e}); the controller writes it as it starts") from None


def process_started(pid: int) -> float | None:
    """The start time of process ``pid`` on this node; None when there is no such process (or only its zombie)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except (psutil.NoSuchProcess, ValueError):  # ValueError: a negative pid
        return None


def process_runs(pid: int, started: float) -> bool:
    """Whether process ``pid``, started at ``started``, still runs on this node (not another that reuses its pid)."""
    now = process_started(pid)
    return now is not None and abs(now - started) < _SAME_START_S
