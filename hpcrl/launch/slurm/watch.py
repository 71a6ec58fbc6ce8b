"""The state of a scheduler's Slurm jobs, read from squeue and sacct, and cancelling them by id.

One ``JobWatcher`` serves every group of a scheduler: ``state(job)`` answers from a cache that is
refreshed at most every ``cache_s`` with one ``squeue`` for all the jobs still watched (slurmctld's
live view, which keeps ended jobs for MinJobAge), then one ``sacct`` for those squeue no longer knows
(slurmdbd's record). Every call has a timeout; a call that fails or times out keeps the last known
state and is logged, so a slow slurmctld delays a failure report but never invents one. Final
states never change, so those are kept for good.

A job is named by ``JobRef``: ``123`` for a job of its own, ``123+1`` for component 1 of
heterogeneous job 123 (how squeue and sacct show components; submitit's own watcher does not know
them and reports such jobs as UNKNOWN).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# states after which a job (or component) runs no more; "CANCELLED by 0" is read as CANCELLED
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)
CALL_TIMEOUT_S = 20.0  # the longest one squeue, sacct or scancel may take


@dataclass(frozen=True)
class JobRef:
    """A job sbatch printed the id of, or one component of it (a heterogeneous job)."""

    job_id: str  # the id sbatch printed (a hetjob's: its leader's)
    component: int | None = None  # the hetjob component, or None for a job of its own

    @property
    def name(self) -> str:
        """How squeue and sacct name it: ``123`` or ``123+1``."""
        return self.job_id if self.component is None else f"{self.job_id}+{self.component}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class JobState:
    state: str  # Slurm's state, e.g. RUNNING or FAILED; UNKNOWN before either tool has shown the job
    exit_code: str = ""  # sacct's ExitCode of an ended job, "code:signal", e.g. 7:0; "" if not known
    reason: str = ""  # squeue's reason a job waits (or ended), e.g. Resources; "" if none

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def __str__(self) -> str:
        details = [f"exit code {self.exit_code}"] if self.exit_code else []
        details += [f"reason: {self.reason}"] if self.reason not in ("", "None") else []
        return f"{self.state} ({', '.join(details)})" if details else self.state


UNKNOWN = JobState("UNKNOWN")


class JobWatcher:
    """States of many jobs, from at most one squeue and one sacct per ``cache_s`` seconds."""

    def __init__(self, cache_s: float = 2.0, timeout_s: float = CALL_TIMEOUT_S):
        self.cache_s = cache_s
        self.timeout_s = timeout_s
        self._jobs: dict[str, JobRef] = {}  # by name
        self._states: dict[str, JobState] = {}
        self._checked = float("-inf")  # monotonic time of the last refresh
        # sacct shows jobs active since then: Slurm reuses job ids (after a reset), and sacct -j alone would
        # answer with an older job of the same id; a minute's margin for clocks that differ
        self._since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 60))
        self._lock = threading.Lock()  # check_alive may come from several threads

    def watch(self, job: JobRef) -> None:
        with self._lock:
            self._jobs[job.name] = job
            self._checked = float("-inf")  # a new job: the cache says nothing about it

    def forget(self, job: JobRef) -> None:
        """Drop ``job``'s state, final or not, so that the next ``state`` reads it anew: a job submitted with
        ``--requeue`` may come back from a state that is otherwise final (``fleet.py``)."""
        with self._lock:
            self._states.pop(job.name, None)
            self._checked = float("-inf")

    def state(self, job: JobRef) -> JobState:
        """``job``'s state, at most ``cache_s`` old (final states are kept for good)."""
        with self._lock:
            if job.name not in self._jobs:
                self._jobs[job.name] = job
                self._checked = float("-inf")
            if time.monotonic() - self._checked >= self.cache_s:
                self._refresh()
                self._checked = time.monotonic()
            return self._states.get(job.name, UNKNOWN)

    def _refresh(self) -> None:
        open_jobs = [name for name in self._jobs if not self._states.get(name, UNKNOWN).final]
        if not open_jobs:
            return
        ids = sorted({self._jobs[name].job_id for name in open_jobs})
        seen = self._squeue(ids)
        self._states.update((name, state) for name, state in seen.items() if name in self._jobs)
        # squeue shows an ended job's state but not its exit code; sacct has both, once slurmdbd has it
        ask = sorted({self._jobs[n].job_id for n in open_jobs if n not in seen or seen[n].final})
        if ask:
            for name, state in self._sacct(ask).items():
                if name in self._jobs and (state.final or name not in seen):
                    self._states[name] = state

    def _squeue(self, ids: list[str]) -> dict[str, JobState]:
        out = _call(["squeue", "-h", "-a", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%r"], self.timeout_s)
        rows = (line.split("|", 2) for line in (out or "").splitlines())
        return {r[0].strip(): JobState(r[1].strip(), reason=r[2].strip()) for r in rows if len(r) == 3}

    def _sacct(self, ids: list[str]) -> dict[str, JobState]:
        fields = ["-o", "JobID,State,ExitCode"]
        out = _call(["sacct", "-n", "-P", "-X", "-S", self._since, "-j", ",".join(ids), *fields], self.timeout_s)
        rows = (line.split("|") for line in (out or "").splitlines())
        return {r[0]: JobState(r[1].split()[0], r[2]) for r in rows if len(r) == 3 and r[1]}


def cancel(job_ids: Iterable[str], timeout_s: float = CALL_TIMEOUT_S) -> None:
    """``scancel`` the jobs, by id (a hetjob's id cancels every component); already ended ones are fine."""
    ids = sorted(set(job_ids))
    if ids:
        log.info("cancelling Slurm jobs %s", ", ".join(ids))
        _call(["scancel", *ids], timeout_s, quiet=True)


def wait_gone(job_ids: Iterable[str], timeout_s: float, poll_s: float = 0.5) -> list[str]:
    """Wait until squeue lists none of the jobs (not even COMPLETING); the ids still listed at the deadline."""
    ids = sorted(set(job_ids))
    deadline = time.monotonic() + timeout_s
    while ids:
        out = _call(["squeue", "-h", "-a", "-j", ",".join(ids), "-o", "%i"], CALL_TIMEOUT_S, quiet=True)
        if out is not None:
            listed = {line.strip().split("+")[0] for line in out.splitlines() if line.strip()}
            ids = [i for i in ids if i in listed]
        if not ids or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return ids


def _call(argv: list[str], timeout_s: float, quiet: bool = False) -> str | None:
    """stdout of ``argv``, or None when it failed or ran out of time (logged)."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        log.warning("%s did not answer within %g s", argv[0], timeout_s)
        return None
    except OSError as e:
        log.warning("cannot run %s: %s", argv[0], e)
        return None
    if result.returncode != 0:
        # squeue -j with ids slurmctld has forgotten fails with "Invalid job id specified": not an error here
        if not (quiet or "Invalid job id" in result.stderr):
            log.warning("%s failed (exit %d): %s", " ".join(argv[:2]), result.returncode, result.stderr.strip())
        return None if "Invalid job id" not in result.stderr else ""
    return result.stdout
