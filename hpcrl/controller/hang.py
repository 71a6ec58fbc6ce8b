"""The hang report: what a run writes when a worker does not answer within its deadline, before the run fails.

Two deadlines count: a trainer or critic call with no reply within ``cluster.hang_timeout_s`` (``stalled_call``),
and a worker whose lease the controller could not renew for ``cluster.worker_lease_s`` (``lost_worker``: a stopped
process, a cut-off node).

    <run dir>/hang_report/
        summary.txt                what went unanswered and by whom (role, rank, node, pid, address), the call
                                   and when it was made; then every other process of the run
        stacks/<role>-<rank>.txt   each process's Python stacks: its own (faulthandler, ``hpcrl/launch/stacks.py``),
                                   or py-spy's for one that did not answer: run here for one on the controller's
                                   host, through srun inside its own Slurm job for one on another node

The controller's call deadline comes before the collectives' (``hpcrl/train/dist.py``), so when it passes every
rank is still inside the stalled call. Each process is then asked for its stacks: a rank that answers is alive, and
its stacks show where it waits (a collective, usually); a rank that answers neither the call nor the stack request
is stopped, or stuck where none of its threads runs: the report and the console line name it first. An earlier
run's report in the same run directory is moved aside (``hang_report.1``, ...). The run then fails as any failed
run does: leaving the scheduler's block ends every process and cancels every Slurm job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.launch.base import WorkerFailed, WorkerGroup
from hpcrl.launch.registry import Entry
from hpcrl.launch.stacks import Jobs, Stacks, request_stacks
from hpcrl.rpc.errors import RpcTimeoutError

if TYPE_CHECKING:  # for its type only: importing hpcrl.launch.slurm loads submitit, of no use to a local run
    from hpcrl.launch.slurm.watch import JobRef

REPORT_DIR = "hang_report"  # in the run directory
SUMMARY_FILE = "summary.txt"
# a worker on a node cut off from the network may also have ended itself by then (its own lease ran out)
SILENT = "answered neither that nor a request for its stacks (stopped, stuck where none of its threads runs, or gone):"
WAITING = "did not answer that, answered a request for its stacks (alive: its stacks show where it waits):"
STACKS_WAIT_S = 10.0  # how long the workers get to write their stacks (they look for a request every second)


class HangError(RuntimeError):
    """A worker did not answer within its deadline; ``report`` is the hang report's summary file."""

    def __init__(self, cause: str, report: Path):
        self.report = report
        super().__init__(f"{cause}; the hang report, with every process's stacks: {report}")


@dataclass(frozen=True)
class Unanswered:
    """What went unanswered (a call and its deadline, in words), and the addresses of the workers that did not."""

    what: str
    addresses: frozenset[str]


def stalled_call(error: BaseException) -> Unanswered | None:
    """The call of ``error``'s fan-out that had no reply in time, from every rank that gave none; None if
    ``error`` is not such a call."""
    if not isinstance(error, RpcTimeoutError):
        return None
    stalled = [error, *(e for e in error.others if isinstance(e, RpcTimeoutError))]
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(error.started))
    what = f"{error.method} within {error.timeout_s:g} s (cluster.hang_timeout_s; called at {since})"
    return Unanswered(what, frozenset(e.address for e in stalled))


def lost_worker(error: BaseException, lost: dict[str, dict[int, str]], entries: list[Entry]) -> Unanswered | None:
    """The worker whose lease the controller could not renew (``lost``: by role, each group's ``WorkerGroup.lost``),
    if ``error`` is its failure; else None."""
    if not isinstance(error, WorkerFailed):
        return None
    # the reason the lease keeper gave is the failure's state (a local worker's), or part of it (a Slurm job's)
    ranks = {rank for rank, why in lost.get(error.role, {}).items() if why in str(error.state)}
    if not ranks:
        return None
    addresses = frozenset(e.address for e in entries if e.role == error.role and e.rank in ranks)
    return Unanswered("the controller's heartbeat (cluster.worker_lease_s)", addresses)


def write_hang_report(
    run_dir: Path,
    entries: list[Entry],
    unanswered: Unanswered,
    stacks_wait_s: float = STACKS_WAIT_S,
    jobs: Jobs | None = None,
) -> tuple[str, Path]:
    """Gather every registered worker's stacks, write the report into ``run_dir``/hang_report; (the headline: one
    line naming who did not answer, the summary file). ``jobs``: each role's Slurm job, if it runs as one, and each
    worker's, if it runs as one of its own (``slurm_jobs``)."""
    out = _fresh_dir(Path(run_dir) / REPORT_DIR)
    stacks = request_stacks(run_dir, out / "stacks", entries, stacks_wait_s, jobs)
    headline, text = summarize(unanswered, stacks, out)
    summary = out / SUMMARY_FILE
    summary.write_text(text)
    return headline, summary


def summarize(unanswered: Unanswered, stacks: list[Stacks], out: Path) -> tuple[str, str]:
    """(the console's headline, the summary file's text) for what went unanswered and what each worker's stack
    request got."""
    late = unanswered.addresses
    silent = [s for s in stacks if s.entry.address in late and not s.answered]
    waiting = [s for s in stacks if s.entry.address in late and s.answered]
    others = [s for s in stacks if s.entry.address not in late]
    if silent:
        headline = f"{_names(silent)} did not answer {unanswered.what}, nor a request for its stacks"
    else:
        headline = f"{_names(waiting)} did not answer {unanswered.what}; each answered a request for its stacks"
    lines = [f"hang report: {headline}", ""]
    lines += _section(SILENT, silent, out) + _section(WAITING, waiting, out)
    lines += _section("the run's other processes:", others, out)
    return headline, "\n".join(lines) + "\n"


def slurm_jobs(groups: list[WorkerGroup]) -> dict[str | tuple[str, int], JobRef]:
    """The Slurm job of each role that runs as one, by role, and of each worker that runs as one of its own (a
    fleet's: ``SlurmFleet.rank_jobs``), by (role, rank); a local group has none. Of a role's groups the last wins
    (the servers' group now, after a restart)."""
    jobs: dict[str | tuple[str, int], JobRef] = {}
    for g in groups:
        if (job := getattr(g, "job", None)) is not None:
            jobs[g.role] = job
        for rank, job in getattr(g, "rank_jobs", {}).items():
            jobs[g.role, rank] = job
    return jobs


def _names(stacks: list[Stacks]) -> str:
    return "; ".join(f"{s.entry.role} rank {s.entry.rank} on node {s.entry.node} (pid {s.entry.pid})" for s in stacks)


def _section(title: str, stacks: list[Stacks], out: Path) -> list[str]:
    if not stacks:
        return []
    lines = [title]
    for s in stacks:
        e = s.entry
        where = s.path.relative_to(out) if s.path is not None else "no stacks"
        lines.append(f"  {e.role} rank {e.rank}  node {e.node}  pid {e.pid}  address {e.address}: {where} ({s.note})")
    return [*lines, ""]


def _fresh_dir(path: Path) -> Path:
    """``path``, made empty: an earlier report there is moved aside to ``<path>.1``, ``<path>.2``, ..."""
    if path.exists():
        n = 1
        while path.with_name(f"{path.name}.{n}").exists():
            n += 1
        path.rename(path.with_name(f"{path.name}.{n}"))
    path.mkdir(parents=True)
    return path
