"""The ``local`` scheduler: every worker is a child process of the controller, on this machine.

    controller (LocalScheduler, a ChildGroup)
    ├── <role> 0 .. <role> W-1            plain roles: one child per worker  -> logs/<role>-<rank>.log
    └── python -m torch.distributed.run   torchrun roles: one child          -> logs/<role>-launcher.log
        └── rank 0 .. W-1                 each rank's output                  -> logs/<role>-<rank>.log

Workers get their identity through the process environment, never a shell string: ``HPCRL_RUN_DIR``,
``HPCRL_ROLE``, ``HPCRL_RANK``, ``HPCRL_WORLD_SIZE``, ``HPCRL_PORT_SLOT_BASE``, ``HPCRL_PORT_WORLD``,
``CUDA_VISIBLE_DEVICES`` (this machine's GPUs are split among the workers that ask for them; a worker
asking for none sees none), plus the spec's ``env``.

A torchrun role runs ``torchrun --nnodes=1 --nproc-per-node=W --max-restarts=0`` with a c10d rendezvous
on a port of the controller's slot. Each rank starts as ``python -m hpcrl.launch.local --rank-log``,
which points its stdout and stderr at ``<role>-<rank>.log``, sets ``HPCRL_RANK`` from torchrun's ``RANK``
and then execs the spec's argv; so a rank's traceback lands in its own log, as a plain worker's does.

Failures: ``check_alive`` raises ``WorkerFailed`` as soon as a worker's process has exited. For a torchrun
role that is when torchrun exits (it does as soon as one rank fails, with ``--max-restarts=0``); the
failing rank and its exit code come from torchrun's error report, and the error carries that rank's
log tail followed by the launcher's.

Cleanup: ``LocalScheduler`` is a context manager built on ``ChildGroup``: leaving it normally, by an
exception, by Ctrl-C or by SIGTERM ends every worker's whole process tree by PID. torchrun starts
ranks in sessions of their own, so the group also remembers every rank it has seen (and every PID
ranks registered) and ends those that outlive torchrun, e.g. after torchrun was SIGKILLed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import psutil

from hpcrl.launch.base import ROLE_ENV, RUN_DIR_ENV, RoleSpec, Scheduler, WorkerFailed, WorkerGroup, worker_env
from hpcrl.launch.process import Child, ChildGroup, _signals_held, read_tail, stop_all
from hpcrl.launch.registry import Registry
from hpcrl.launch.slots import RANK_ENV, TORCHRUN_RANK_ENV, PortSlots
from hpcrl.net import format_hostport
from hpcrl.rundir import RunDir

log = logging.getLogger(__name__)

GPU_ENV = "CUDA_VISIBLE_DEVICES"
LOG_LINES = 40  # log lines a WorkerFailed carries
_RDZV_HOST = "127.0.0.1"  # every rank is on this machine
# torchrun's failure report: "Root Cause ...:\n[0]:\n  ...\n  rank      : 1 (local_rank: 1)\n  exitcode  : 3 (pid: 12)"
_TORCHRUN_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


class LocalScheduler(Scheduler):
    """Starts worker groups as subprocesses of this process; ``with`` ends them all on exit.

    ``slots`` numbers every listener of the run (``PortSlots``); ``net_port_range`` is the port range
    they share (None: the default range). ``gpus`` are the GPU ids to hand out (default: every GPU of
    this machine, or those in ``CUDA_VISIBLE_DEVICES``). ``grace_s`` is how long a worker gets between
    SIGTERM and SIGKILL.
    """

    def __init__(
        self,
        run_dir: RunDir,
        slots: PortSlots,
        net_port_range: tuple[int, int] | None = None,
        *,
        gpus: Sequence[str] | None = None,
        grace_s: float = 10.0,
    ):
        self.run_dir = run_dir
        self.slots = slots
        self.registry = Registry(run_dir.registry)
        # The controller's own ports (torchrun rendezvous); the controller should draw any other port it
        # listens on from here too, since a second allocator over the same slot could hand out a port twice.
        self.ports = slots.allocator(slots.controller, net_port_range)
        self.grace_s = grace_s
        self._children = ChildGroup(grace_s)
        self._groups: list[LocalWorkerGroup] = []
        self._gpus = list(visible_gpus() if gpus is None else gpus)
        self._free_gpus = list(self._gpus)

    def start(self, spec: RoleSpec) -> LocalWorkerGroup:
        self._check(spec)
        gpus = self._take_gpus(spec)
        self.registry.clear(spec.role)  # entries of an earlier attempt must not count as ready
        env = worker_env(self.run_dir.path, spec, self.slots)
        children: list[Child] = []

        def spawn_worker(rank: int) -> Child:
            mine = gpus[rank * spec.gpus_per_worker : (rank + 1) * spec.gpus_per_worker]
            worker = {**env, RANK_ENV: str(rank), **_gpu_env(spec, mine)}
            log_file = self.run_dir.log_file(spec.role, rank)
            return self._children.spawn(f"{spec.role} {rank}", spec.argv, log_file, env=worker)

        try:
            if spec.torchrun:
                children.append(self._spawn_torchrun(spec, env, gpus))
            for rank in range(0 if spec.torchrun else spec.workers):
                children.append(spawn_worker(rank))
        except BaseException:  # a half-started group holds neither processes nor GPUs
            stop_all(children, self.grace_s)
            self._release(gpus)()
            raise
        group = LocalWorkerGroup(spec, self.registry, children, self.run_dir, self.grace_s, self._release(gpus))
        group.spawn_worker = spawn_worker
        self._groups.append(group)
        return group

    def close(self) -> None:
        with _signals_held():  # a second Ctrl-C must not cut the cleanup short; it is raised after it
            for group in self._groups:
                group._track_ranks()  # while torchrun still leads them
            try:
                self._children.stop()  # every tree at once, with one shared grace period
            finally:
                for group in self._groups:
                    group.stop()

    def __enter__(self) -> LocalScheduler:
        self._children.__enter__()  # from here SIGTERM and SIGINT unwind through __exit__
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            self._children.__exit__(*exc)

    def _check(self, spec: RoleSpec) -> None:
        if spec.nodes != 1:
            raise ValueError(f"{spec.role}: the local scheduler runs every worker on this machine; nodes must be 1")
        self.slots.base(spec.role)  # a role without slots is the clearer error
        counted = self.slots.counts[spec.role]
        if counted != spec.workers:
            raise ValueError(
                f"{spec.role}: the spec has {spec.workers} workers but the run's PortSlots counts {counted}; "
                "build PortSlots from the same allocation as the specs"
            )

    def _take_gpus(self, spec: RoleSpec) -> list[str]:
        if GPU_ENV in spec.env:
            log.info("%s: %s=%r comes from the spec; handing out no GPUs", spec.role, GPU_ENV, spec.env[GPU_ENV])
            return []
        need = spec.workers * spec.gpus_per_worker
        if need > len(self._free_gpus):
            raise ValueError(
                f"{spec.role} needs {spec.workers} x {spec.gpus_per_worker} GPUs, but only {len(self._free_gpus)} of "
                f"this machine's GPUs are free ({', '.join(self._free_gpus) or 'none'}); lower the role's GPUs "
                "or stop the group holding them"
            )
        taken, self._free_gpus = self._free_gpus[:need], self._free_gpus[need:]
        return taken

    def _release(self, gpus: list[str]) -> Callable[[], None]:
        def release() -> None:
            self._free_gpus = sorted([*self._free_gpus, *gpus], key=self._gpus.index)
            gpus.clear()  # a second stop returns nothing

        return release

    def _spawn_torchrun(self, spec: RoleSpec, env: dict[str, str], gpus: list[str]) -> Child:
        endpoint = format_hostport(_RDZV_HOST, self.ports.allocate(1)[0])
        rank_log = str(self.run_dir.logs / f"{spec.role}-{{rank}}.log")
        cmd = torchrun_command(spec.argv, spec.workers, endpoint, rank_log, rdzv_id=spec.role)
        log_file = self.run_dir.logs / f"{spec.role}-launcher.log"
        return self._children.spawn(f"{spec.role} torchrun", cmd, log_file, env={**env, **_gpu_env(spec, gpus)})


_EXIT_POLL_S = 0.05  # how often wait_exited looks at the children


class LocalWorkerGroup(WorkerGroup):
    """One role's children: W workers, or one torchrun whose W ranks are its children."""

    def __init__(
        self,
        spec: RoleSpec,
        registry: Registry,
        children: list[Child],
        run_dir: RunDir,
        grace_s: float,
        on_stop: Callable[[], None],
    ):
        super().__init__(spec, registry)
        self.children = children
        self.run_dir = run_dir
        self.grace_s = grace_s
        self._on_stop = on_stop
        self._ranks: dict[int, psutil.Process] = {}  # torchrun ranks seen so far, by PID
        self.dropped: set[int] = set()  # workers that died and that the run goes on without
        self.spawn_worker: Callable[[int], Child] | None = None  # starts worker <rank> (plain roles)

    def check_alive(self) -> None:
        if self.spec.torchrun:
            self._check_torchrun(self.children[0])
        else:
            for rank, child in enumerate(self.children):
                code = child.poll()
                if code is not None and rank not in self.dropped:
                    raise WorkerFailed(self.role, rank, code, child.log_tail(LOG_LINES), child.log_file)
        self._check_reachable(ignore=self.dropped)

    def drop(self, rank: int) -> None:
        """Stop checking worker ``rank``: it has died (or cannot be reached) and the run goes on without it.
        What is left of it is ended, and its registry entry forgotten."""
        self.dropped.add(rank)
        if rank in self.lost:
            self.children[rank].stop(self.grace_s)
        self.registry.unregister(self.role, rank)

    def restart(self, rank: int) -> None:
        """Start worker ``rank`` again after it died: what is left of its tree is ended, its registry entry
        forgotten, and a new process (same argv, environment, GPUs and log file) registers when it is ready.
        Plain roles only: a torchrun rank cannot rejoin its group."""
        if self.spec.torchrun or self.spawn_worker is None:
            raise ValueError(f"{self.role}: only a plain role's workers can be restarted, not torchrun ranks")
        old = self.children[rank]
        if old.alive() and rank not in self.lost:
            raise ValueError(f"{self.role} worker {rank} (pid {old.pid}) is still running; only a dead one restarts")
        old.stop(self.grace_s)  # e.g. an SGLang server's scheduler processes outlive their dead leader
        self.registry.unregister(self.role, rank)
        self.children[rank] = self.spawn_worker(rank)
        self.dropped.discard(rank)
        self.lost.pop(rank, None)
        log.warning("%s worker %d restarted as pid %d", self.role, rank, self.children[rank].pid)

    def wait_exited(self, timeout_s: float) -> bool:
        """Each child (a worker, or torchrun once its ranks are done) polled until it has exited."""
        deadline = time.monotonic() + timeout_s
        while any(child.alive() for child in self.children):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_EXIT_POLL_S)
        return True

    def stop(self) -> None:
        self._track_ranks()
        try:
            stop_all(self.children, self.grace_s)
        finally:
            self._stop_lost_ranks()
            self._on_stop()

    def _check_torchrun(self, launcher: Child) -> None:
        self._track_ranks()
        code = launcher.poll()
        if code is None:
            return
        report = launcher.log_tail(400)
        root_cause = _TORCHRUN_FAILURE.search(report, max(report.rfind("Root Cause"), 0))
        if root_cause is None:
            raise WorkerFailed(self.role, "torchrun", code, launcher.log_tail(LOG_LINES), launcher.log_file)
        rank, rank_code = int(root_cause[1]), int(root_cause[2])
        rank_log = self.run_dir.log_file(self.role, rank)
        tail = (
            f"{read_tail(rank_log, LOG_LINES).rstrip() or '<empty log>'}\n"
            f"--- torchrun exited with {code} (log: {launcher.log_file}); its last lines:\n"
            f"{launcher.log_tail(15)}"
        )
        raise WorkerFailed(self.role, rank, rank_code, tail, rank_log)

    def _track_ranks(self) -> None:
        """Remember torchrun's ranks, which live in sessions of their own (out of reach once torchrun is gone)."""
        if not self.spec.torchrun:
            return
        launcher = self.children[0]._process
        with contextlib.suppress(psutil.Error):
            if launcher.is_running():
                self._ranks.update((p.pid, p) for p in launcher.children(recursive=True))
        with contextlib.suppress(OSError, ValueError, TypeError):
            for entry in self.registry.entries(self.role):
                if entry.pid not in self._ranks and entry.node == socket.gethostname():
                    proc = _ours(entry.pid, str(self.run_dir.path), self.role)
                    if proc is not None:
                        self._ranks[entry.pid] = proc

    def _stop_lost_ranks(self) -> None:
        procs = [p for p in self._ranks.values() if _running(p)]
        if not procs:
            return
        log.warning("%s: ending ranks %s, which outlived torchrun", self.role, [p.pid for p in procs])
        for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 5.0)):
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            _, procs = psutil.wait_procs(procs, timeout=wait_s)
            if not procs:
                return
        log.error("%s: pids %s survived SIGKILL", self.role, [p.pid for p in procs])


def torchrun_command(
    argv: Sequence[str],
    nproc: int,
    rdzv_endpoint: str,
    rank_log: str,
    rdzv_id: str,
    nnodes: int = 1,
    extra: Sequence[str] = (),
) -> list[str]:
    """torchrun (this interpreter's) running ``argv`` as ``nproc`` ranks on each of ``nnodes`` nodes; rank r's
    output goes to ``rank_log`` with ``{rank}`` replaced by r. ``extra``: more torchrun options."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        *extra,
        "--no-python",
        sys.executable,
        "-m",
        "hpcrl.launch.local",
        "--rank-log",
        rank_log,
        "--",
        *argv,
    ]


def visible_gpus() -> list[str]:
    """The GPU ids this process may hand out: ``CUDA_VISIBLE_DEVICES`` when set, else one per /dev/nvidiaN."""
    value = os.environ.get(GPU_ENV)
    if value is not None:
        return [gpu.strip() for gpu in value.split(",") if gpu.strip()]
    # Count, not names: in a container /dev/nvidia3 may be the only GPU, which CUDA calls 0.
    return [str(i) for i in range(len(list(Path("/dev").glob("nvidia[0-9]*"))))]


def _gpu_env(spec: RoleSpec, gpus: list[str]) -> dict[str, str]:
    if GPU_ENV in spec.env:
        return {}
    return {GPU_ENV: ",".join(gpus)}  # "" hides every GPU from a worker that asked for none


def _ours(pid: int, run_dir: str, role: str) -> psutil.Process | None:
    """The process ``pid`` if it is a worker of this run and role (PIDs get reused), else None."""
    try:
        proc = psutil.Process(pid)
        env = proc.environ()
    except psutil.Error:
        return None
    return proc if env.get(RUN_DIR_ENV) == run_dir and env.get(ROLE_ENV) == role else None


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _rank_main(argv: list[str] | None = None) -> NoReturn:
    """``python -m hpcrl.launch.local --rank-log TEMPLATE -- PROGRAM...``: how torchrun starts one rank.

    Sends this process's stdout and stderr to TEMPLATE with ``{rank}`` replaced by torchrun's RANK,
    sets HPCRL_RANK to it, then execs PROGRAM (same PID, so torchrun still watches the rank itself).
    """
    parser = argparse.ArgumentParser(prog="python -m hpcrl.launch.local", description=_rank_main.__doc__)
    parser.add_argument("--rank-log", required=True, help="log file of the rank; {rank} is replaced")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- then the argv of the rank's program")
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    rank = os.environ.get(TORCHRUN_RANK_ENV)
    if not program or rank is None:
        parser.error("needs RANK in the environment (set by torchrun) and a program after --")
    path = Path(args.rank_log.format(rank=rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    header = f"--- hpcrl: starting rank {rank} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(program)}\n"
    os.write(fd, header.encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ[RANK_ENV] = rank
    try:
        os.execvp(program[0], program)
    except OSError as e:
        print(f"hpcrl: cannot start rank {rank}: {shlex.join(program)}: {e}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    _rank_main()
