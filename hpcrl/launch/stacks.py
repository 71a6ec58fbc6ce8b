"""Every worker's Python stacks on request, for a hang report (``hpcrl/controller/hang.py``).

    worker:     watch_stack_requests(run_dir, role, rank) at start: a daemon thread polls
                <run dir>/stacks.request every POLL_S; on a request id it has not answered, faulthandler writes
                every thread's stack to <its dir>/<role>-<rank>.txt (a temporary file, then linked there: a reader
                never sees half of it, and a late answer never replaces stacks py-spy read)
    controller: request_stacks(run_dir, out_dir, entries, timeout_s, jobs): writes the request, waits until
                timeout_s for each registered worker's file; for a worker that wrote none,
                ``py-spy dump --nonblocking --pid P`` (it reads the process's memory and never stops it, so it
                reads a stopped process too): here if it runs on this host, else on its node inside its own Slurm
                job (``jobs``: by role, or by (role, rank) where each worker is a job of its own), as
                ``srun --jobid=J [--het-group=K] --overlap --nodelist=NODE --nodes=1 --ntasks=1 py-spy ...``;
                each with a deadline of its own, past which it is killed by PID

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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.launch.registry import Entry
from hpcrl.rundir import write_atomic

if TYPE_CHECKING:  # for its type only: importing hpcrl.launch.slurm loads submitit, of no use to a worker
    from hpcrl.launch.slurm.watch import JobRef

log = logging.getLogger(__name__)
REQUEST_FILE = "stacks.request"  # in the run directory
POLL_S = 1.0  # how often a worker looks for a request: one stat a second on the shared filesystem
PY_SPY_TIMEOUT_S = 10.0  # py-spy's deadline for one process
SRUN_PY_SPY_TIMEOUT_S = 30.0  # srun's: a job step to start on the node (slurmctld may be busy), then py-spy
SRUN_STOP_S = 5.0  # how long a late srun gets to end its step after SIGTERM, before SIGKILL


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
    """Every thread's stack, as faulthandler writes it, into ``path`` (linked into place when complete,
    unless py-spy's are there already)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with partial.open("w") as f:
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, answering at {time.strftime('%H:%M:%S')}\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    try:  # never over py-spy's: a process stopped past the deadline answers once resumed (Slurm's SIGCONT, SIGTERM)
        os.link(partial, path)
    except FileExistsError:
        log.info("a hang report already has this process's stacks (%s): not replacing them", path)
    finally:
        partial.unlink()


# --- the controller's side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stacks:
    """What a stack request got from one worker."""

    entry: Entry
    answered: bool  # it wrote its own stacks (its threads run)
    path: Path | None  # the stacks, its own or py-spy's; None: none could be taken
    note: str  # how they were taken, or why none were


# the Slurm job a worker runs in: its role's (one job for all of them), or its own (role, rank)'s (fleet.py)
Jobs = Mapping["str | tuple[str, int]", "JobRef"]


def request_stacks(
    run_dir: Path, out_dir: Path, entries: list[Entry], timeout_s: float, jobs: Jobs | None = None
) -> list[Stacks]:
    """Ask every worker in ``entries`` for its stacks into ``out_dir``; what each did, in the order given. ``jobs``:
    the Slurm job of each role run as one, or of each worker run as one, where py-spy reads a silent worker on
    another node."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(run_dir) / REQUEST_FILE, json.dumps({"id": secrets.token_hex(8), "dir": str(out_dir)}))
    deadline = time.monotonic() + timeout_s
    waiting = list(entries)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        waiting = [e for e in waiting if not stack_file(out_dir, e).exists()]
    here, jobs = socket.gethostname(), jobs or {}
    spied = _py_spy_all([e for e in waiting if e.node == here or job_of(jobs, e)], out_dir, here, jobs)
    (Path(run_dir) / REQUEST_FILE).unlink(missing_ok=True)  # answered or not, too late for this report
    found = []
    for entry in entries:
        if entry not in waiting:
            found.append(Stacks(entry, True, stack_file(out_dir, entry), "written by the process itself"))
        elif (entry.role, entry.rank) in spied:
            found.append(Stacks(entry, False, *spied[entry.role, entry.rank]))
        else:
            found.append(Stacks(entry, False, None, f"none: not on this host ({here}), where py-spy could read it"))
    return found


def job_of(jobs: Jobs, entry: Entry) -> JobRef | None:
    """The Slurm job ``entry``'s worker runs in: its own, else its role's; None if neither is known."""
    return jobs.get((entry.role, entry.rank)) or jobs.get(entry.role)


def srun_argv(job: JobRef, node: str, argv: list[str]) -> list[str]:
    """``argv`` as one task on ``node`` inside ``job``'s allocation, beside its running steps (``--overlap``: it
    needs none of their CPUs or memory)."""
    component = [] if job.component is None else [f"--het-group={job.component}"]
    where = [f"--nodelist={node}", "--nodes=1", "--ntasks=1"]
    return ["srun", f"--jobid={job.job_id}", *component, "--overlap", *where, "--quiet", *argv]


def _py_spy_all(
    entries: list[Entry], out_dir: Path, here: str, jobs: Jobs
) -> dict[tuple[str, int], tuple[Path | None, str]]:
    """``py-spy dump`` of each process at once, here or through srun on its node, each within its deadline: by
    (role, rank), its stacks' file (None if py-spy got none) and a note saying how they were taken or why none
    were."""
    exe = _py_spy()
    if exe is None:
        return {(e.role, e.rank): (None, "none: py-spy is not installed here") for e in entries}
    found: dict[tuple[str, int], tuple[Path | None, str]] = {}
    running = {}
    for e in entries:
        dump = [exe, "dump", "--nonblocking", "--pid", str(e.pid)]
        remote = e.node != here
        if remote and shutil.which("srun") is None:
            found[e.role, e.rank] = (None, "none: not on this host, and srun is not installed here")
            continue
        job = job_of(jobs, e)
        argv = srun_argv(job, e.node, dump) if remote and job is not None else dump
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        running[e.role, e.rank] = (proc, remote)
    start = time.monotonic()
    for e in entries:
        if (e.role, e.rank) in running:
            proc, remote = running[e.role, e.rank]
            limit_s = SRUN_PY_SPY_TIMEOUT_S if remote else PY_SPY_TIMEOUT_S
            found[e.role, e.rank] = _py_spy_result(proc, start + limit_s, limit_s, remote, stack_file(out_dir, e))
    return found


def _py_spy_result(
    proc: subprocess.Popen, deadline: float, limit_s: float, remote: bool, path: Path
) -> tuple[Path | None, str]:
    how = "py-spy through srun" if remote else "py-spy"
    try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _end(proc, remote)
        return None, f"none: {how} read nothing within {limit_s:g} s"
    if proc.returncode != 0:
        last = (out.strip().splitlines() or ["no output"])[-1]
        return None, f"none: {how} failed ({last})"
    path.write_text(out)
    if remote:
        return path, "read by py-spy (dump --nonblocking) on its node, through srun: the process did not answer itself"
    return path, "read by py-spy (dump --nonblocking): the process did not answer itself"


def _end(proc: subprocess.Popen, remote: bool) -> None:
    """End a late py-spy, or srun: SIGTERM first, on which srun ends its step's task on the node, then SIGKILL."""
    if remote:
        proc.terminate()
        try:
            proc.communicate(timeout=SRUN_STOP_S)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.communicate()


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # the virtualenv's
    return str(beside) if beside.exists() else shutil.which("py-spy")
