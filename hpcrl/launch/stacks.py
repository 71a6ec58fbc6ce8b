"""Every worker's Python stacks on request, for a hang report (``hpcrl/controller/hang.py``).

    worker:     watch_stack_requests(run_dir, role, rank) at start: a daemon thread polls
                <run dir>/stacks.request every POLL_S; on a request id it has not answered, faulthandler writes
                every thread's stack to <its dir>/<role>-<rank>.txt (a temporary file, then renamed: a reader never
                sees half of it)
    controller: request_stacks(run_dir, out_dir, entries, timeout_s): writes the request, waits until timeout_s
                for each registered worker's file; for a worker that wrote none and runs on this host,
                ``py-spy dump --nonblocking --pid P`` (it reads the process's memory and never stops it, so it
                reads a stopped process too), each with a deadline of its own

Why a file in the run directory rather than a signal: on Slurm the workers run on other nodes, out of the
controller's reach, and the run directory is on a filesystem every node shares. A process whose threads cannot
run (stopped by SIGSTOP, or one whose C call holds the GIL) cannot answer: that is what names it in the report.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.launch.registry import Entry
from hpcrl.rundir import write_atomic

log = logging.getLogger(__name__)
REQUEST_FILE = "stacks.request"  # in the run directory
POLL_S = 1.0  # how often a worker looks for a request: one stat a second on the shared filesystem
PY_SPY_TIMEOUT_S = 10.0  # py-spy's deadline for one process


def stack_file(out_dir: Path, entry: Entry) -> Path:
    return out_dir / f"{entry.role}-{entry.rank}.txt"


# --- the worker's side ------------------------------------------------------------------------------------


def watch_stack_requests(run_dir: Path, role: str, rank: int, poll_s: float = POLL_S) -> threading.Thread:
    """Start the daemon thread that answers the controller's stack requests for this process (see above)."""
    request = Path(run_dir) / REQUEST_FILE
    answered = {_request(request).get("id")}  # one left by an earlier run in this directory is not for us

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            asked = _request(request)
            if asked.get("id") in answered or "dir" not in asked:
                continue
            answered.add(asked["id"])
            try:
                _dump(Path(asked["dir"]) / f"{role}-{rank}.txt")
            except OSError as e:  # the report says this worker did not answer; the next request may work
                log.warning("could not write this process's stacks for a hang report: %s", e)

    thread = threading.Thread(target=watch, name="stack-requests", daemon=True)
    thread.start()
    return thread


def _request(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none yet (or one being replaced: write_atomic renames, so only a vanished one)
        return {}


def _dump(path: Path) -> None:
    """Every thread's stack, as faulthandler writes it, into ``path`` (renamed into place when complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with partial.open("w") as f:
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, answering at {time.strftime('%H:%M:%S')}\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    partial.replace(path)


# --- the controller's side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stacks:
    """What a stack request got from one worker."""

    entry: Entry
    answered: bool  # it wrote its own stacks (its threads run)
    path: Path | None  # the stacks, its own or py-spy's; None: none could be taken
    note: str  # how they were taken, or why none were


def request_stacks(run_dir: Path, out_dir: Path, entries: list[Entry], timeout_s: float) -> list[Stacks]:
    """Ask every worker in ``entries`` for its stacks into ``out_dir``; what each did, in the order given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(run_dir) / REQUEST_FILE, json.dumps({"id": secrets.token_hex(8), "dir": str(out_dir)}))
    deadline = time.monotonic() + timeout_s
    waiting = list(entries)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        waiting = [e for e in waiting if not stack_file(out_dir, e).exists()]
    here = socket.gethostname()
    spied = _py_spy_all([e for e in waiting if e.node == here], out_dir)
    found = []
    for entry in entries:
        if entry not in waiting:
            found.append(Stacks(entry, True, stack_file(out_dir, entry), "written by the process itself"))
        elif (entry.role, entry.rank) in spied:
            found.append(Stacks(entry, False, *spied[entry.role, entry.rank]))
        else:
            found.append(Stacks(entry, False, None, f"none: not on this host ({here}), where py-spy could read it"))
    return found


def _py_spy_all(entries: list[Entry], out_dir: Path) -> dict[tuple[str, int], tuple[Path | None, str]]:
    """``py-spy dump`` of each process at once, all within PY_SPY_TIMEOUT_S: by (role, rank), its stacks' file
    (None if py-spy got none) and a note saying how they were taken or why none were."""
    exe = _py_spy()
    if exe is None:
        return {(e.role, e.rank): (None, "none: py-spy is not installed here") for e in entries}
    cmds = {(e.role, e.rank): [exe, "dump", "--nonblocking", "--pid", str(e.pid)] for e in entries}
    running = {key: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for key, cmd in cmds.items()}  # fmt: skip
    deadline = time.monotonic() + PY_SPY_TIMEOUT_S
    return {(e.role, e.rank): _py_spy_result(running[e.role, e.rank], deadline, stack_file(out_dir, e))
            for e in entries}  # fmt: skip


def _py_spy_result(proc: subprocess.Popen, deadline: float, path: Path) -> tuple[Path | None, str]:
    try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None, f"none: py-spy read nothing within {PY_SPY_TIMEOUT_S:g} s"
    if proc.returncode != 0:
        last = (out.strip().splitlines() or ["no output"])[-1]
        return None, f"none: py-spy failed ({last})"
    path.write_text(out)
    return path, "read by py-spy (dump --nonblocking): the process did not answer itself"


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # the virtualenv's
    return str(beside) if beside.exists() else shutil.which("py-spy")
