"""The scheduler seam: start a role's worker group, wait until every worker is ready, stop it.

    with LocalScheduler(run_dir, PortSlots({"server": 1, "trainer": 2})) as scheduler:
        servers = scheduler.start(RoleSpec("server", [python, "-m", "hpcrl.inference.worker"], workers=1))
        trainers = scheduler.start(RoleSpec("trainer", [python, "-m", "hpcrl.train.worker"], workers=2, torchrun=True))
        entries = servers.wait_ready() + trainers.wait_ready()  # fails at once if a worker dies
        ...
        servers.check_alive()  # raises WorkerFailed once any worker has ended
    # leaving the block (normally, by an exception, Ctrl-C or SIGTERM) stops every worker's process tree

A worker is ready when it has registered ``host:port`` in the run's registry (``Registry``); the
worker does this itself, once it serves, so registration means ready. Each worker finds who it is in
its environment (the ``*_ENV`` names below, set by every scheduler) and writes its output to
``<run_dir>/logs/<role>-<rank>.log``.

``local`` (``local.py``) runs workers as subprocesses of the controller; ``slurm`` (``slurm/``) submits them.
"""

from __future__ import annotations

import logging
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.launch.process import _describe_exit
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slots import PORT_WORLD_ENV, RANK_ENV, SLOT_BASE_ENV, PortSlots

log = logging.getLogger(__name__)

RUN_DIR_ENV = "HPCRL_RUN_DIR"  # the run directory (config.yaml, logs/, registry/)
ROLE_ENV = "HPCRL_ROLE"  # the worker's role, e.g. server
WORLD_SIZE_ENV = "HPCRL_WORLD_SIZE"  # workers in the role
WORKER_ENV = (RUN_DIR_ENV, ROLE_ENV, RANK_ENV, WORLD_SIZE_ENV, SLOT_BASE_ENV, PORT_WORLD_ENV)

_ROLE_NAME = re.compile(r"[A-Za-z0-9_]+")  # no "-": logs and registry files are named <role>-<rank>


@dataclass(frozen=True)
class RoleSpec:
    """One role's worker group: what each worker runs and what it needs."""

    role: str  # registry and log name of the role, e.g. server or trainer
    argv: list[str]  # the program of one worker, argv[0] an executable (under torchrun: of one rank)
    workers: int = 1  # workers in the group (under torchrun: ranks, the world size)
    nodes: int = 1  # nodes the group spans (local: 1)
    gpus_per_worker: int = 0  # GPUs each worker owns; 0 = none (local hides every GPU from it)
    cpus_per_worker: int = 1  # CPU cores per worker (Slurm --cpus-per-task; local does not pin cores)
    torchrun: bool = False  # run the workers as the ranks of one torchrun per node, one process per rank
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every worker
    setup_timeout_s: float = 600.0  # seconds every worker gets to register once started
    resources: Any = None  # scheduler-specific extras (Slurm partition, time, sbatch options); local ignores it
    # each worker of the role is a Slurm job of its own (one worker on one node), so that one can end, be replaced
    # or be requeued without the others; local ignores it: its workers are separate processes already
    job_per_worker: bool = False

    def __post_init__(self) -> None:
        where = f"RoleSpec({self.role!r})"
        if not isinstance(self.role, str) or not _ROLE_NAME.fullmatch(self.role):
            raise ValueError(f"{where}: the role must be letters, digits and '_' (it names files <role>-<rank>)")
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"{where}: argv must be a non-empty list of strings, got {self.argv!r}")
        for name in ("workers", "nodes", "cpus_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"{where}: {name} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"{where}: gpus_per_worker must be >= 0, got {self.gpus_per_worker}")
        if self.workers % self.nodes:
            raise ValueError(f"{where}: workers={self.workers} must split evenly over nodes={self.nodes}")
        if self.job_per_worker and self.torchrun:
            raise ValueError(f"{where}: job_per_worker needs a plain role: torchrun's ranks are one world in one job")
        if not self.setup_timeout_s > 0:
            raise ValueError(f"{where}: setup_timeout_s must be > 0 seconds, got {self.setup_timeout_s}")
        reserved = sorted(set(self.env) & set(WORKER_ENV))
        if reserved:
            raise ValueError(f"{where}: env must not set {', '.join(reserved)}; the scheduler sets them per worker")


def worker_env(run_dir: Path, spec: RoleSpec, slots: PortSlots) -> dict[str, str]:
    """The environment every worker of ``spec`` gets (without its rank, which differs per worker)."""
    return {
        **spec.env,
        RUN_DIR_ENV: str(run_dir),
        ROLE_ENV: spec.role,
        WORLD_SIZE_ENV: str(spec.workers),
        **slots.env(spec.role),
    }


class WorkerFailed(RuntimeError):
    """A worker of a group ended (or was lost) while the group was still needed."""

    def __init__(self, role: str, worker: int | str, state: int | str, log_tail: str, log_file: Path | None = None):
        self.role, self.worker, self.state, self.log_tail, self.log_file = role, worker, state, log_tail, log_file
        what = f"exited with {_describe_exit(state)}" if isinstance(state, int) else state
        where = f" (log: {log_file})" if log_file else ""
        tail = log_tail.rstrip() or "<empty log>"
        super().__init__(f"{role} worker {worker} {what}{where}; last log lines:\n{tail}")

    @property
    def exit_code(self) -> int | None:
        return self.state if isinstance(self.state, int) else None


class WorkerRequeued(WorkerFailed):
    """A worker whose Slurm job went back to the queue (preempted, or ``scontrol requeue``d, a job submitted with
    ``--requeue``): it is gone for now, and comes back by itself, registering anew once it serves again."""


class WorkerGroup(ABC):
    """The running workers of one role; a context manager that stops them on exit."""

    def __init__(self, spec: RoleSpec, registry: Registry):
        self.spec = spec
        self.registry = registry
        self.lost: dict[int, str] = {}  # rank -> why: alive for all we know, but the controller cannot reach it

    @property
    def role(self) -> str:
        return self.spec.role

    def mark_lost(self, rank: int, why: str) -> None:
        """The controller can no longer reach worker ``rank`` (its lease keeper says so: ``lease.py``), so the
        worker counts as ended: ``check_alive`` raises for it, as for one that died, until it is let go."""
        self.lost.setdefault(rank, why)

    def _check_reachable(self, ignore: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        for rank, why in list(self.lost.items()):  # the lease keeper's thread may add one meanwhile
            if rank not in ignore:
                raise WorkerFailed(self.role, rank, why, "")

    @abstractmethod
    def check_alive(self) -> None:
        """Raise ``WorkerFailed`` (role, worker, exit code or state, log tail) if any worker has ended."""

    def wait_ready(self, timeout_s: float | None = None) -> list[Entry]:
        """Every worker's registry entry, by rank, once all have registered.

        Waits at most ``timeout_s`` (default: the spec's ``setup_timeout_s``), then raises
        TimeoutError; raises ``WorkerFailed`` as soon as a worker dies, not at the deadline.
        """
        timeout_s = self.spec.setup_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        entries = self.registry.wait(self.role, self.spec.workers, timeout_s, check_alive=self.check_alive)
        log.info(
            "%s: %d workers ready in %.1f s: %s",
            self.role,
            len(entries),
            time.monotonic() - start,
            ", ".join(e.address for e in entries),
        )
        return entries

    def queued(self) -> bool:
        """Whether the group still waits for resources (a Slurm job in the queue): time that does not count
        against the setup timeout. Raises when it has waited too long. Local workers never wait."""
        return False

    def wait_exited(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for every worker, told to shut down, to exit on its own; whether all did.
        Ones left are ended by ``stop`` as before. A group that cannot see its processes (Slurm) waits for none."""
        return False

    @abstractmethod
    def stop(self) -> None:
        """End every worker's process tree (SIGTERM, then SIGKILL after a grace period). Idempotent."""

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Scheduler(ABC):
    """Starts worker groups; a context manager that stops every group it started on exit."""

    @abstractmethod
    def start(self, spec: RoleSpec) -> WorkerGroup:
        """Start ``spec``'s workers (clearing the role's old registry entries first); returns at once."""

    def start_all(self, specs: list[RoleSpec]) -> list[WorkerGroup]:
        """Start several roles; a scheduler may place them together (Slurm: one heterogeneous job)."""
        return [self.start(spec) for spec in specs]

    @abstractmethod
    def close(self) -> None:
        """Stop every group this scheduler started. Idempotent."""

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
