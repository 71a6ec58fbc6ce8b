"""The one way hpcrl starts and ends a child process.

``spawn`` runs an argv list (never a shell string; a fixed ``sh`` that ignores SIGUSR2 execs it in the same
process, ``IGNORE_USR2``) in its own session, so the child leads its own
process group and a Ctrl-C at the terminal reaches only this process, which then stops its children
itself. stdin is ``/dev/null``; stdout and stderr are appended to one log file.

``Child.stop`` ends the whole tree by PID, never by name: it collects the child, its descendants
(psutil) and any process left in the child's session (the grandchildren of a leader that already
died, e.g. the scheduler processes of a crashed inference server), sends SIGTERM to all of them,
waits up to a grace period, then SIGKILLs what is left and collects again so that processes forked
during the grace period are not missed. ``stop_all`` does this for many children with one shared
grace period.

Cleanup on every path: ``ChildGroup`` is a context manager that stops its children when the block
exits, normally or by an exception. While a group is active in the main thread, SIGTERM raises
``SystemExit(143)`` and SIGINT raises ``KeyboardInterrupt``, so a cancelled Slurm job or a Ctrl-C
unwinds through ``__exit__`` like any other error; the previous handlers come back on exit. A signal
that arrives while a child is being registered or while children are being stopped is held back
until that step is done, so it can neither leak a child nor cut a cleanup short.

Bounded: an entry point that calls ``end_within(seconds)`` (``hpcrl.main`` does) ends for certain once
signalled. The first SIGTERM or SIGINT starts a deadline; if the orderly unwinding above has not ended the
process by then (a thread blocked on a slow reward, a hung worker, a loop that will not yield), or at a
second SIGTERM or SIGINT, every descendant of this process is SIGKILLed, every cleanup registered with
``add_last_resort`` runs (Slurm jobs are cancelled by id) and the process exits with 128 + the signal.

Not covered: a parent killed with SIGKILL (or by the OOM killer) runs no cleanup; its workers end when
their lease on it runs out (``lease.py``), and on Slurm the job's cgroup ends what is left. A descendant
that calls ``setsid`` and whose parent has died is out of reach of both the tree and the session scan.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a stop checks whether the processes it signalled are gone
_KILL_WAIT_S = 5.0  # how long a stop waits for SIGKILLed processes before giving up on them
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_deadline_s: float | None = None  # end_within(): after a first signal, the process ends within this for certain
_last_resort: list[Callable[[], None]] = []  # cleanups besides SIGKILLing descendants (Slurm: scancel by id)
_signals_seen = 0


def end_within(seconds: float) -> None:
    """Once SIGTERM or SIGINT has come, end this process within ``seconds`` whatever it is doing (an entry
    point's promise; a library never makes it), and at once on a second one."""
    global _deadline_s
    _deadline_s = seconds


def add_last_resort(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run ``cleanup`` if the process has to end at once (see ``end_within``); returns it, for ``remove``."""
    _last_resort.append(cleanup)
    return cleanup


def remove_last_resort(cleanup: Callable[[], None]) -> None:
    with contextlib.suppress(ValueError):
        _last_resort.remove(cleanup)


class ChildExited(RuntimeError):
    """A child process ended while something still needed it."""

    def __init__(self, name: str, pid: int, exit_code: int, log_tail: str, log_file: Path | None = None):
        self.name, self.pid, self.exit_code, self.log_tail, self.log_file = name, pid, exit_code, log_tail, log_file
        where = f" (log: {log_file})" if log_file else ""
        tail = log_tail.rstrip() or "<empty log>"
        super().__init__(f"{name} (pid {pid}) exited with {_describe_exit(exit_code)}{where}; last log lines:\n{tail}")


class Child:
    """A running child process started by ``spawn``; ``with`` stops it on exit."""

    def __init__(self, name: str, popen: subprocess.Popen, log_file: Path):
        self.name = name
        self.log_file = log_file
        self._popen = popen
        # A psutil.Process remembers the creation time, so signals sent through it can never reach
        # an unrelated process that reused the PID after this child was reaped.
        self._process = psutil.Process(popen.pid)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        return self._popen.poll()

    def alive(self) -> bool:
        return self.poll() is None

    def check_alive(self) -> None:
        """Raise ``ChildExited`` if the child has ended; waits call this so a dead child fails them at once."""
        code = self.poll()
        if code is not None:
            raise ChildExited(self.name, self.pid, code, self.log_tail(), self.log_file)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the log file ("" if there is none yet)."""
        return read_tail(self.log_file, lines)

    def stop(self, grace_s: float = 10.0) -> None:
        """End the child's whole process tree: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
        stop_all([self], grace_s)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Child({self.name!r}, pid={self.pid}, exit_code={self.poll()})"


def spawn(
    name: str,
    cmd: Sequence[str],
    log_file: Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Child:
    """Start ``cmd`` as a child in a new session, its output appended to ``log_file``, ignoring SIGUSR2.

    The child's environment is ``os.environ`` updated with ``env``; values travel through the process
    environment untouched (no quoting, no expansion: ``IGNORE_USR2``'s shell passes them on as they are). A
    program that is not there raises here, as ``subprocess.Popen`` would.
    """
    argv = [str(part) for part in cmd]
    if not argv:
        raise ValueError(f"spawn({name!r}): the command is empty; pass an argv list such as [python, -m, module]")
    env = dict(env or {})
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(f"spawn({name!r}): environment keys and values must be strings, got {bad!r}")
    changed = sorted(k for k, v in env.items() if os.environ.get(k) != v)
    log.info("starting %s: %s%s", name, shlex.join(argv), f" (env: {', '.join(changed)})" if changed else "")

    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        program = _executable(argv[0], {**os.environ, **env}, cwd)
    except OSError as e:
        e.add_note(f"while starting {name}: {shlex.join(argv)} (cwd: {cwd or os.getcwd()})")
        raise
    with open(log_file, "ab") as out:
        out.write(f"--- hpcrl: starting {name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(argv)}\n".encode())
        out.flush()
        try:
            popen = subprocess.Popen(
                [*IGNORE_USR2, program, *argv[1:]],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as e:
            e.add_note(f"while starting {name}: {shlex.join(argv)} (cwd: {cwd or os.getcwd()})")
            raise
    try:
        child = Child(name, popen, log_file)
    except BaseException:
        popen.kill()
        popen.wait()
        raise
    log.info("started %s as pid %d, log: %s", name, child.pid, log_file)
    return child


# A shell that ignores SIGUSR2 and execs the command (same PID); the signal stays ignored across exec and in the
# command's children. Slurm sends its preemption and time-limit warning (--signal=USR2@N) to every process of a
# job step; only the controller acts on it (checkpoint, then requeue: hpcrl/controller/preempt.py), and a worker
# killed by it would fail the run first. Not a preexec_fn: Python code between fork and exec is unsafe in a parent
# with threads (a forked child of a threaded test segfaulted there), and every parent here has threads.
IGNORE_USR2 = ["/bin/sh", "-c", 'trap "" USR2; exec "$@"', "sh"]  # then the command to exec


def _executable(program: str, env: Mapping[str, str], cwd: str | Path | None) -> str:
    """``program`` as exec finds it: a path (relative to ``cwd``) as it is, a name on ``env``'s PATH. Raises what
    exec would, before the shell is started, where a missing program would only be a late exit 127."""
    if os.sep in program:
        path = Path(cwd or ".") / program
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        if path.is_dir() or not os.access(path, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
        return program
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, f"{os.strerror(errno.ENOENT)} on PATH", program)
    return found


def stop_all(children: Iterable[Child], grace_s: float = 10.0) -> None:
    """Stop many children with one shared grace period: SIGTERM every tree, wait once, SIGKILL the rest."""
    children = list(children)
    with _signals_held():
        procs: dict[int, psutil.Process] = {}
        for child in children:
            procs.update(_tree(child))
        if procs:
            log.info("stopping %s (%d processes)", ", ".join(c.name for c in children), len(procs))
        _send(procs.values(), signal.SIGTERM)
        left = _wait_gone(children, procs, grace_s)
        for child in children:  # collect again: a process may have forked during the grace period
            left.update(_tree(child))
        left = {pid: p for pid, p in left.items() if not _gone(p)}
        if left:
            log.warning("pids %s did not exit %g s after SIGTERM; sending SIGKILL", sorted(left), grace_s)
            _send(left.values(), signal.SIGKILL)
            still = _wait_gone(children, left, _KILL_WAIT_S)
            if still:
                log.error("pids %s survived SIGKILL (uninterruptible sleep?); giving up on them", sorted(still))
        for child in children:
            child.poll()  # reap the leader, so it leaves no zombie behind


class ChildGroup:
    """Children that share one owner: ``with ChildGroup() as g: g.spawn(...)`` stops them all on exit.

    In the main thread, entering the group turns SIGTERM into ``SystemExit(143)`` and SIGINT into
    ``KeyboardInterrupt`` (a signal the process ignores stays ignored); leaving restores the handlers.
    """

    def __init__(self, grace_s: float = 10.0):
        self.grace_s = grace_s  # seconds each child gets between SIGTERM and SIGKILL
        self.children: list[Child] = []
        self._previous: dict[int, Any] = {}  # signal -> the handler to restore on exit

    def spawn(
        self,
        name: str,
        cmd: Sequence[str],
        log_file: Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> Child:
        """``spawn`` a child and own it; a signal during the start is raised once it is registered."""
        with _signals_held():
            child = spawn(name, cmd, log_file, env=env, cwd=cwd)
            self.children.append(child)
        return child

    def check_alive(self) -> None:
        """Raise ``ChildExited`` for the first child that has ended."""
        for child in self.children:
            child.check_alive()

    def stop(self) -> None:
        stop_all(self.children, self.grace_s)

    def __enter__(self) -> ChildGroup:
        if threading.current_thread() is threading.main_thread():
            for signum in _HANDLED_SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = previous
                    signal.signal(signum, _on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            self._previous.clear()


# Signals are delivered to the main thread only, so this state needs no lock.
_held = 0  # > 0 while a step that must not be interrupted runs
_pending: int | None = None  # the first signal that arrived while held


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _pending, _signals_seen
    _signals_seen += 1
    if _deadline_s is not None:
        if _signals_seen == 1:
            threading.Thread(target=_end_after, args=(signum, _deadline_s), name="end-deadline", daemon=True).start()
        else:
            _end_now(signum, "a second signal")
    if _held:
        _pending = _pending or signum
        return
    _raise_for(signum)


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _end_after(signum: int, seconds: float) -> None:
    time.sleep(seconds)
    _end_now(signum, f"still running {seconds:g} s after {signal.Signals(signum).name}")


def _end_now(signum: int, why: str) -> None:
    """The last resort: SIGKILL every descendant, run the registered cleanups, exit. No logging: this may run in
    a signal handler that interrupted a logging call (its lock would deadlock)."""
    os.write(2, f"hpcrl: {why}: killing every process of the run and exiting now\n".encode())
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    for cleanup in list(_last_resort):
        try:
            cleanup()
        except BaseException as e:  # the others must still run
            os.write(2, f"hpcrl: a last-resort cleanup failed: {e!r}\n".encode())
    os._exit(128 + signum)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold back ``_on_signal``'s exception until the block is done, then raise it.

    Only the main thread holds: the handler runs there, so that is where the exception belongs.
    """
    global _held, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending is not None:
            signum, _pending = _pending, None
            _raise_for(signum)


def _tree(child: Child) -> dict[int, psutil.Process]:
    """The child (if not yet reaped), its descendants, and the processes left in its session."""
    procs: dict[int, psutil.Process] = {}
    leader = child._process
    if leader.is_running():  # False once reaped or if the PID now belongs to someone else
        procs[leader.pid] = leader
        with contextlib.suppress(psutil.Error):
            procs.update((p.pid, p) for p in leader.children(recursive=True))
    elif psutil.pid_exists(leader.pid):
        return procs  # the PID was reused: a session of that number is not ours
    # The kernel keeps a PID from reuse while a session of that number has members, so members of
    # session <child pid> are the child's own descendants, even those orphaned when it died.
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid not in procs and os.getsid(p.pid) == leader.pid:
                procs[p.pid] = p
                procs.update((c.pid, c) for c in p.children(recursive=True))
    return procs


def _send(procs: Iterable[psutil.Process], sig: signal.Signals) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)


def _gone(p: psutil.Process) -> bool:
    """Exited; a zombie counts, since only its parent (or init) can reap it and it holds no resources."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE or not p.is_running()
    except psutil.NoSuchProcess:
        return True


def _wait_gone(children: list[Child], procs: dict[int, psutil.Process], timeout_s: float) -> dict[int, psutil.Process]:
    """Wait until every process in ``procs`` is gone or ``timeout_s`` passes; return those left."""
    deadline = time.monotonic() + timeout_s
    left = dict(procs)
    while True:
        for child in children:
            child.poll()  # reap our own children so they do not linger as zombies
        left = {pid: p for pid, p in left.items() if not _gone(p)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(_POLL_S)


def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"exit code {code} (killed by {signal.Signals(-code).name})"
    except ValueError:
        return f"exit code {code} (killed by signal {-code})"


def read_tail(path: Path, lines: int = 30, chunk: int = 65536) -> str:
    """The last ``lines`` lines of a text file, read from the end (logs can be large)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            data = b""
            pos = end
            while pos > 0 and data.count(b"\n") <= lines:
                pos = max(0, pos - chunk)
                f.seek(pos)
                data = f.read(end - pos)
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:]) if lines > 0 else ""
