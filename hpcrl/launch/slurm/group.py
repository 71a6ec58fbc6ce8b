"""``SlurmWorkerGroup``: the workers of one role as one Slurm job, or one component of a heterogeneous job.

Its state comes from the scheduler's ``JobWatcher`` (squeue and sacct, cached); ``wait_ready`` counts the
setup timeout from when Slurm starts the job, not from submission; a job that has ended in any way fails
``check_alive`` with the failing worker's log and the ends of the job's output files. The components of one
heterogeneous job end together, all FAILED with its batch script's status: every one of them then reports the
role whose step ended first (``hetjob.ended_first``), whichever group the controller checks first. ``steps.py``'s
``StepWorkerGroup`` is the same group run as an srun step of the controller's own job.
"""

from __future__ import annotations

import glob
import logging
import re
import time
from pathlib import Path

from hpcrl.launch.base import RoleSpec, WorkerFailed, WorkerGroup
from hpcrl.launch.process import _signals_held, read_tail
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slurm.hetjob import ended_first
from hpcrl.launch.slurm.watch import JobRef, JobState, JobWatcher, cancel, wait_gone
from hpcrl.rundir import RunDir

log = logging.getLogger(__name__)

LOG_LINES = 40  # lines of the failing worker's log a WorkerFailed carries
JOB_LOG_LINES = 10  # lines of each of the job's own output files it carries
QUEUED_STATES = frozenset({"PENDING", "UNKNOWN", "REQUEUED", "RESV_DEL_HOLD"})  # submitted, not started yet
# srun's report of a task that failed, e.g. "srun: error: n1: task 1: Exited with exit code 7"
# ("Terminated" is what srun says of the tasks it ended itself, so it names no culprit)
_SRUN_TASK_FAILED = re.compile(r"srun: error: \S+: tasks? (\d+)(?:[-,]\d+)*: (?:Exited|Killed)")
# torchrun's failure report: "Root Cause ...:\n[0]:\n  ...\n  rank      : 1 (local_rank: 1)\n  exitcode  : 3"
_TORCHRUN_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


class SlurmWorkerGroup(WorkerGroup):
    """The workers of one role: one Slurm job, or one component of a heterogeneous job."""

    def __init__(
        self,
        spec: RoleSpec,
        registry: Registry,
        job: JobRef,
        watcher: JobWatcher,
        folder: Path,
        run_dir: RunDir,
        stop_timeout_s: float = 60.0,
        queue_timeout_s: float | None = None,
    ):
        super().__init__(spec, registry)
        self.queue_timeout_s = queue_timeout_s
        self.job = job
        self.watcher = watcher
        self.folder = folder
        self.run_dir = run_dir
        self.stop_timeout_s = stop_timeout_s
        self._stopped = False
        self._queued_since: float | None = None  # when queued() first saw the job waiting
        # a hetjob component's group: the groups of every component of its job, in component order (the scheduler
        # sets them), to name the one whose step ended first
        self.het_groups: list[SlurmWorkerGroup] = []

    @property
    def job_id(self) -> str:
        """How squeue and sacct name this group's job: ``123``, or ``123+1`` for a hetjob component."""
        return self.job.name

    def state(self) -> JobState:
        return self.watcher.state(self.job)

    def wait_ready(self, timeout_s: float | None = None) -> list[Entry]:
        """As ``WorkerGroup.wait_ready``, with the setup timeout counted from when Slurm starts the job.

        Time in the queue does not count against it (a busy cluster may hold a job for hours); it is
        bounded by ``queue_timeout_s`` (None: no bound) and logged every few minutes with Slurm's reason.
        """
        self.wait_started()
        try:
            return super().wait_ready(timeout_s)
        except TimeoutError as e:
            e.add_note(f"Slurm job {self.job} is {self.state()}; its output files are in {self.folder}")
            raise

    def wait_started(self, poll_s: float = 1.0, report_s: float = 300.0) -> JobState:
        """Wait while the job is queued (PENDING, or not yet shown); its state once it runs or has ended."""
        start = reported = time.monotonic()
        while True:
            self.check_alive()
            if not self.queued():  # raises past queue_timeout_s
                return self.state()
            if time.monotonic() - reported >= report_s:
                reported = time.monotonic()
                waited, state = time.monotonic() - start, self.state()
                log.info("%s: Slurm job %s has waited %.0f s in the queue: %s", self.role, self.job, waited, state)
            time.sleep(poll_s)

    def queued(self) -> bool:
        """Whether the job still waits in the queue (not counted against the setup timeout); raises TimeoutError
        once it has waited longer than ``queue_timeout_s``. For waits that poll rather than block."""
        state = self.state()
        if state.state not in QUEUED_STATES:
            return False
        self._queued_since = self._queued_since or time.monotonic()
        waited = time.monotonic() - self._queued_since
        check_queue_wait(self.role, self.job, state, waited, self.queue_timeout_s)
        return True

    def check_alive(self) -> None:
        state = self.state()
        if state.final:
            # scancel ends every component at once, and a step may end before the script: none is the culprit
            culprit = self._first_ended() if state.state != "CANCELLED" else self
            found = culprit.state() if culprit is not self else state
            raise culprit._failure(found if found.final else state)
        self._check_lost(f"job {self.job}")

    def _failure(self, state: JobState) -> WorkerFailed:
        tail, log_file = self._failure_report(state)
        return WorkerFailed(self.role, f"job {self.job}", state.state, tail, log_file)

    def _first_ended(self) -> SlurmWorkerGroup:
        """The group whose step ended first and so ended this one's heterogeneous job; this group itself for a job
        of its own, or when the job's batch script recorded none."""
        k = ended_first(self.folder, self.job.job_id) if self.het_groups else None
        return self.het_groups[k] if k is not None and k < len(self.het_groups) else self

    def _check_lost(self, what: str) -> None:
        """A worker the controller cannot reach fails the whole job (or step): one job holds all of the role."""
        for rank, why in list(self.lost.items()):  # the lease keeper's thread may add one meanwhile
            raise WorkerFailed(self.role, what, f"RUNNING, but its worker {rank} {why}", "")

    def stop(self) -> None:
        """scancel the job by id (a hetjob component: the whole hetjob) and wait until squeue drops it."""
        if self._stopped:
            return
        self._stopped = True
        with _signals_held():
            cancel([self.job.job_id])
            if wait_gone([self.job.job_id], self.stop_timeout_s):
                log.error(
                    "%s: Slurm job %s is still listed %g s after scancel", self.role, self.job, self.stop_timeout_s
                )

    def job_files(self) -> list[Path]:
        """The job's output files in the submitit folder that are not empty: its tasks' stderr and stdout
        (a plain worker writes to its own log; torchrun writes here), srun's and the batch script's."""
        name = glob.escape(self.job.name)
        files = sorted(self.folder.glob(f"{name}_*_log.err")) + sorted(self.folder.glob(f"{name}_*_log.out"))
        if self.job.component is not None:  # srun's own messages, and the batch script's
            files += [self.folder / f"{self.job.name}_srun.err", self.folder / f"{self.job.job_id}_batch.err"]
        return [f for f in files if f.exists() and f.stat().st_size]

    def _failure_report(self, state: JobState) -> tuple[str, Path | None]:
        tails = {f: _job_tail(f) for f in self.job_files()}
        worker_log = self._failed_worker_log("\n".join(read_tail(f, 400) for f in tails))
        parts = [read_tail(worker_log, LOG_LINES).rstrip() or "<empty log>"] if worker_log else []
        parts += [f"--- {f.name}:\n{tail}" for f, tail in tails.items() if tail]
        parts.append(f"--- Slurm: job {self.job} {state}; its output files are in {self.folder}")
        return "\n".join(parts), worker_log

    def _failed_worker_log(self, job_text: str) -> Path | None:
        """The log of the worker srun or torchrun reports as failed, else the role's newest log."""
        if self.spec.torchrun:
            found = _TORCHRUN_FAILURE.search(job_text, max(job_text.rfind("Root Cause"), 0))
        else:
            found = _SRUN_TASK_FAILED.search(job_text)
        if found is not None:
            return self.run_dir.log_file(self.role, int(found[1]))
        logs = [
            p
            for p in self.run_dir.logs.glob(f"{glob.escape(self.role)}-*.log")
            if p.stem[len(self.role) + 1 :].isdigit()
        ]
        return max(logs, key=lambda p: p.stat().st_mtime, default=None)


def check_queue_wait(what: str, job: JobRef, state: JobState, waited_s: float, timeout_s: float | None) -> None:
    """TimeoutError naming ``what`` (a role, or one of its workers) once ``job`` has waited in the queue longer than
    ``timeout_s`` (None: no limit)."""
    if timeout_s is not None and waited_s > timeout_s:
        raise TimeoutError(
            f"{what}: Slurm job {job} is still {state} after {waited_s:.0f} s in the queue; "
            "raise cluster.queue_timeout_min (0 = no limit) or ask for fewer resources"
        )


def _job_tail(path: Path) -> str:
    """The end of one of the job's output files, without submitit's start-up lines."""
    lines = read_tail(path, JOB_LOG_LINES + 5).splitlines()
    return "\n".join([line for line in lines if not line.startswith("submitit INFO")][-JOB_LOG_LINES:]).rstrip()
