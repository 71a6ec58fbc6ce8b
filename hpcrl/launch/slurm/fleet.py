"""``SlurmFleet``: the workers of one role as one Slurm job each (``RoleSpec.job_per_worker``), so that one can end,
be replaced or be requeued while the others go on.

    SlurmScheduler.start(spec)          one single-worker job per rank, <prefix><role>-<rank>, each running
                                        WorkerTask(rank=k): logs/<role>-<k>.log, HPCRL_RANK=k
    fleet.wait_ready()                  every rank registered; each rank's setup timeout counts from its job's start
    fleet.check_alive()                 WorkerFailed(role, k, ...) for a rank whose job ended (or that is lost),
                                        WorkerRequeued(role, k, ...) once for a rank whose job went back to the queue
    fleet.drop(k) / fleet.restart(k)    scancel rank k's job and forget it / submit a new job for rank k
    fleet.stop()                        scancel every job the fleet ever submitted; wait until squeue drops them

How a requeue looks, observed on the test Slurm (``scontrol requeue`` of a running job submitted with
``--requeue``): squeue shows it RUNNING, then COMPLETING (reason None) for about half a second, then PENDING with
reason BeginTime and a start time 2 minutes ahead (Slurm holds a requeued job that long); the job id stays, and
``scontrol show job`` counts ``Restarts=1``. ``sacct -X`` shows REQUEUED while it completes, then PENDING (with
``-D``, both records). So a requeue is a job that had started and is now back in a queued state. Not observed (the
test Slurm preempts nothing): a job preempted with PreemptMode=REQUEUE, or requeued off a failed node, is recorded
PREEMPTED or NODE_FAIL rather than REQUEUED, states that are final for ``JobWatcher``, which keeps those for good.
squeue shows the job's current state (PENDING once requeued), so such a state would come from sacct's record of
the run that ended, asked when squeue did not answer: the fleet reads a job in either state once more
(``JobWatcher.forget``) before it takes it for ended.

A requeued rank's registry entry is stale (its worker is gone): ``check_alive`` removes it and forgets the rank's
lost mark before it raises ``WorkerRequeued``, so whoever waits for the rank waits for its new registration.
"""

from __future__ import annotations

import glob
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcrl.launch.base import RoleSpec, WorkerFailed, WorkerGroup, WorkerRequeued
from hpcrl.launch.process import _signals_held, read_tail
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slurm.group import JOB_LOG_LINES, LOG_LINES, QUEUED_STATES, check_queue_wait
from hpcrl.launch.slurm.watch import JobRef, JobState, JobWatcher, cancel, wait_gone
from hpcrl.rundir import RunDir

log = logging.getLogger(__name__)

# a job that waits again after it ran: requeued (REQUEUE_HOLD: requeued and held, REQUEUE_FED: by a federation)
BACK_IN_QUEUE = QUEUED_STATES | {"REQUEUE_HOLD", "REQUEUE_FED"}
# final states Slurm may requeue a job submitted with --requeue from: read once more before taken for ended
MAY_REQUEUE = frozenset({"PREEMPTED", "NODE_FAIL"})
POLL_S = 0.5  # how often wait_ready looks at the jobs and the registry
# a running job whose worker's entry has been gone this long has lost its worker (Slurm has not seen it yet: a node
# cut off, whose worker ended itself once its lease ran out, is RUNNING until Slurm calls the node down); a requeue
# shows in squeue within a second of its worker's end
UNREGISTERED_GRACE_S = 5.0


@dataclass
class RankJob:
    """What the fleet knows of one rank's current job."""

    job: JobRef
    started: float | None = None  # monotonic time the fleet first saw the job run (since it was last queued)
    queued_since: float | None = None  # monotonic time the fleet first saw it waiting in the queue, this time
    rechecked: bool = False  # its PREEMPTED or NODE_FAIL was read once more (MAY_REQUEUE)
    node: str = ""  # the node its worker registered from ("" until it has)
    unregistered_since: float | None = None  # monotonic time its worker's entry was first seen gone while it runs


class SlurmFleet(WorkerGroup):
    """The workers of one role, one Slurm job per rank. ``submit(rank)`` submits a job for that rank (the
    scheduler's, which records its id, so that the scheduler's exit cancels it) and returns it."""

    def __init__(
        self,
        spec: RoleSpec,
        registry: Registry,
        submit: Callable[[int], JobRef],
        watcher: JobWatcher,
        folder: Path,
        run_dir: RunDir,
        stop_timeout_s: float = 60.0,
        queue_timeout_s: float | None = None,
    ):
        super().__init__(spec, registry)
        self.submit = submit
        self.watcher = watcher
        self.folder = folder  # submitit's: each job's output files
        self.run_dir = run_dir
        self.stop_timeout_s = stop_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.ranks: dict[int, RankJob] = {}  # the ranks checked, each with its current job
        self.dropped: set[int] = set()
        self.every_job: list[JobRef] = []  # every job the fleet submitted, replaced or dropped ones too
        self._stopped = False

    def start(self) -> None:
        """Submit a job for every rank."""
        for rank in range(self.spec.workers):
            self._submit(rank)

    @property
    def rank_jobs(self) -> dict[int, JobRef]:
        """Each rank's current job (not the dropped ones'); a hang report reads a silent worker inside it."""
        return {rank: r.job for rank, r in self.ranks.items()}

    def _submit(self, rank: int) -> JobRef:
        job = self.submit(rank)
        self.every_job.append(job)
        self.ranks[rank] = RankJob(job)
        self.dropped.discard(rank)
        return job

    # --- readiness ----------------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float | None = None) -> list[Entry]:
        """Every rank's registry entry, by rank, once all have registered.

        Each rank gets ``timeout_s`` (default: the spec's ``setup_timeout_s``) from when its job starts: time in
        the queue does not count (it is bounded by ``queue_timeout_s``). Raises ``WorkerFailed`` as soon as a job
        ends, TimeoutError naming the ranks past their time. A rank whose job is requeued meanwhile is waited for
        again, from its job's next start."""
        timeout_s = self.spec.setup_timeout_s if timeout_s is None else timeout_s
        begin = time.monotonic()
        while True:
            try:
                self.check_alive()
            except WorkerRequeued as requeued:
                log.warning("%s worker %s %s", self.role, requeued.worker, requeued.state)
                continue
            self.queued()  # raises past queue_timeout_s
            entries = {e.rank: e for e in self.registry.entries(self.role) if e.rank in self.ranks}
            if len(entries) == len(self.ranks):
                log.info("%s: %d workers ready in %.1f s", self.role, len(entries), time.monotonic() - begin)
                return [entries[rank] for rank in sorted(entries)]
            late = [k for k, r in self.ranks.items() if k not in entries and _past(r.started, timeout_s)]
            if late:
                jobs = ", ".join(f"rank {k}: job {self.ranks[k].job} {self._state(k)}" for k in late)
                raise TimeoutError(
                    f"{self.role} ranks {late} did not register in {self.registry.directory} within {timeout_s:g} s "
                    f"of their Slurm jobs' start ({jobs}); see their logs, or raise "
                    f"cluster.roles.{self.role}.setup_timeout_s"
                )
            time.sleep(POLL_S)

    def queued(self) -> bool:
        """Whether any rank's job waits in the queue (time that does not count against the setup timeout); raises
        TimeoutError once one has waited longer than ``queue_timeout_s``."""
        waiting = False
        for rank, r in self.ranks.items():
            state = self._state(rank)
            if state.state not in BACK_IN_QUEUE:
                r.queued_since = None
                continue
            waiting = True
            r.queued_since = r.queued_since or time.monotonic()
            check_queue_wait(
                f"{self.role} worker {rank}", r.job, state, time.monotonic() - r.queued_since, self.queue_timeout_s
            )
        return waiting

    # --- failures -----------------------------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raise ``WorkerFailed`` for the first rank (by rank) whose job has ended in any way, or that the lease
        keeper marked lost; ``WorkerRequeued``, once per requeue, for one whose job went back to the queue after it
        had run. Dropped ranks are not checked."""
        for rank in sorted(self.ranks):
            state = self._state(rank)
            if state.final:
                raise self._failure(rank, f"ended: {self._where(rank)} is {state}", state)
            if self._requeued(rank, state):
                raise self._requeue(rank, state)
            if state.state not in BACK_IN_QUEUE:
                self.ranks[rank].started = self.ranks[rank].started or time.monotonic()
                self._check_registered(rank)
            why = self.lost.get(rank)
            if why is not None:
                raise WorkerFailed(self.role, rank, f"{why} ({self._where(rank)} is {state})", "")

    def _check_registered(self, rank: int) -> None:
        """A running rank whose worker registered and whose entry has since been gone for ``UNREGISTERED_GRACE_S``
        counts as lost (its worker ended, or ends, while Slurm still counts the job as running)."""
        r = self.ranks[rank]
        entry = next((e for e in self.registry.entries(self.role) if e.rank == rank), None)
        if entry is not None:
            r.node, r.unregistered_since = entry.node, None
            return
        if not r.node:  # it has not registered yet
            return
        r.unregistered_since = r.unregistered_since or time.monotonic()
        gone_s = time.monotonic() - r.unregistered_since
        if gone_s > UNREGISTERED_GRACE_S:
            why = f"on node {r.node} left the registry {gone_s:.0f} s ago while its job runs: its worker has ended"
            self.lost.setdefault(rank, why)

    def _state(self, rank: int) -> JobState:
        """Rank ``rank``'s job's state; a final one that Slurm may requeue from is read once more first."""
        r = self.ranks[rank]
        state = self.watcher.state(r.job)
        if state.state in MAY_REQUEUE and not r.rechecked:
            r.rechecked = True
            self.watcher.forget(r.job)
            state = self.watcher.state(r.job)
        return state

    def _requeued(self, rank: int, state: JobState) -> bool:
        """Whether rank ``rank``'s job is back in the queue after it ran: the fleet saw it run, or its worker
        registered (it may have started and gone between two looks)."""
        if state.state not in BACK_IN_QUEUE:
            return False
        r = self.ranks[rank]
        if r.started is not None:
            return True
        if not any(e.rank == rank for e in self.registry.entries(self.role)):
            return False
        # the entry may be newer than the cached state (a worker registers once its job runs, and a state may be
        # cache_s old): read it anew, else a replacement that registered within cache_s of its start would be taken
        # for requeued and its entry removed, and it would never be seen ready
        self.watcher.forget(r.job)
        return self.watcher.state(r.job).state in BACK_IN_QUEUE

    def _requeue(self, rank: int, state: JobState) -> WorkerRequeued:
        """Forget what rank ``rank``'s worker was (its entry, its lost mark, its start); the failure saying so."""
        what = f"went back to the queue: {self._where(rank)} is {state}; it registers anew once it runs again"
        failure = WorkerRequeued(self.role, rank, what, *self._report(rank, state))
        r = self.ranks[rank]
        self.ranks[rank] = RankJob(r.job)  # it has not run since; a later PREEMPTED is read once more again
        self.registry.unregister(self.role, rank)
        self.lost.pop(rank, None)
        return failure

    def _where(self, rank: int) -> str:
        """``its Slurm job 123 (node n2)``: the node the worker registered from, when it did."""
        entry = next((e for e in self.registry.entries(self.role) if e.rank == rank), None)
        node = entry.node if entry else self.ranks[rank].node
        return f"its Slurm job {self.ranks[rank].job}" + (f" (node {node})" if node else "")

    def _failure(self, rank: int, what: str, state: JobState) -> WorkerFailed:
        return WorkerFailed(self.role, rank, what, *self._report(rank, state))

    def _report(self, rank: int, state: JobState) -> tuple[str, Path]:
        """(the tail of rank ``rank``'s log, then of its job's output files; its log file)."""
        worker_log = self.run_dir.log_file(self.role, rank)
        parts = [read_tail(worker_log, LOG_LINES).rstrip() or "<empty log>"]
        for f in self.job_files(rank):
            lines = read_tail(f, JOB_LOG_LINES + 5).splitlines()
            tail = "\n".join([x for x in lines if not x.startswith("submitit INFO")][-JOB_LOG_LINES:]).rstrip()
            if tail:
                parts.append(f"--- {f.name}:\n{tail}")
        parts.append(f"--- Slurm: job {self.ranks[rank].job} {state}; its output files are in {self.folder}")
        return "\n".join(parts), worker_log

    def job_files(self, rank: int) -> list[Path]:
        """Rank ``rank``'s job's output files in the submitit folder that are not empty."""
        name = glob.escape(self.ranks[rank].job.name)
        files = sorted(self.folder.glob(f"{name}_*_log.err")) + sorted(self.folder.glob(f"{name}_*_log.out"))
        return [f for f in files if f.stat().st_size]

    # --- one rank -----------------------------------------------------------------------------------------

    def drop(self, rank: int) -> None:
        """Stop checking rank ``rank``: the run goes on without it. Its job is cancelled (by id; not waited for:
        ``stop`` does that) and its registry entry forgotten."""
        r = self.ranks.pop(rank, None)
        self.dropped.add(rank)
        self.lost.pop(rank, None)
        if r is not None:
            cancel([r.job.job_id])
        self.registry.unregister(self.role, rank)
        log.warning("%s worker %d dropped (Slurm job %s cancelled)", self.role, rank, r.job if r else "none")

    def restart(self, rank: int) -> None:
        """Replace rank ``rank``: its job (ended, lost, back in the queue, or dropped) is cancelled, its registry
        entry forgotten, and a new job submitted for it, whose worker registers when it is ready. A job that runs a
        worker the controller can still reach is not replaced."""
        old = self.ranks.get(rank)
        if old is not None:
            state = self._state(rank)
            if state.state not in BACK_IN_QUEUE and not state.final and rank not in self.lost:
                raise ValueError(
                    f"{self.role} worker {rank}: its Slurm job {old.job} is {state}; only an ended, lost or queued "
                    "one is replaced"
                )
            cancel([old.job.job_id])
        self.registry.unregister(self.role, rank)
        self.lost.pop(rank, None)
        job = self._submit(rank)
        was = f"job {old.job}" if old else "dropped"
        log.warning("%s worker %d replaced: Slurm job %s submitted (was %s)", self.role, rank, job, was)

    # --- the end ------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """scancel every job the fleet submitted (by id) and wait until squeue drops them. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        ids = [job.job_id for job in self.every_job]
        with _signals_held():
            cancel(ids)
            left = wait_gone(ids, self.stop_timeout_s)
            if left:
                log.error("%s: Slurm jobs %s are still listed %g s after scancel", self.role, left, self.stop_timeout_s)


def _past(started: float | None, timeout_s: float) -> bool:
    return started is not None and time.monotonic() - started > timeout_s
