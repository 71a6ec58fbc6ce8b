"""The hang report: what a run writes when a trainer or critic call has no reply within ``cluster.hang_timeout_s``.

    <run dir>/hang_report/
        summary.txt                which processes did not answer (role, rank, node, pid, address), the call they
                                   did not answer and since when, then every other process of the run
        stacks/<role>-<rank>.txt   each process's Python stacks: its own (faulthandler, ``hpcrl/launch/stacks.py``),
                                   or py-spy's for one on the controller's host that did not answer

The controller's deadline comes before the collectives' (``hpcrl/train/dist.py``), so when it passes every rank
is still inside the stalled call. Each process is then asked for its stacks: a rank that answers is alive, and its
stacks show where it waits (a collective, usually); a rank that answers neither the call nor the stack request is
stopped, or stuck where none of its threads runs: the report and the console line name it first. An earlier
run's report in the same run directory is moved aside (``hang_report.1``, ...). The run then fails as any failed
run does: leaving the scheduler's block ends every process and cancels every Slurm job.
"""

from __future__ import annotations

import time
from pathlib import Path

from hpcrl.launch.registry import Entry
from hpcrl.launch.stacks import Stacks, request_stacks
from hpcrl.rpc.errors import RpcTimeoutError

REPORT_DIR = "hang_report"  # in the run directory
SUMMARY_FILE = "summary.txt"
SILENT = "did not answer the call, nor the stack request (stopped, or stuck where none of its threads runs):"
WAITING = "did not answer the call, answered the stack request (alive: its stacks show where it waits):"
STACKS_WAIT_S = 10.0  # how long the workers get to write their stacks (they look for a request every second)


class HangError(RuntimeError):
    """A call had no reply within its deadline; ``report`` is the hang report's summary file."""

    def __init__(self, message: str, report: Path):
        self.report = report
        super().__init__(message)


def stalled_calls(error: BaseException) -> list[RpcTimeoutError]:
    """The per-rank calls of ``error``'s fan-out that had no reply in time, if ``error`` is such a call; else []."""
    if not isinstance(error, RpcTimeoutError):
        return []
    return [error, *(e for e in error.others if isinstance(e, RpcTimeoutError))]


def write_hang_report(
    run_dir: Path, entries: list[Entry], stalled: list[RpcTimeoutError], stacks_wait_s: float = STACKS_WAIT_S
) -> HangError:
    """Gather every registered worker's stacks, write the report into ``run_dir``/hang_report and return the
    error the run fails with: one line naming who did not answer, and where the report is."""
    out = _fresh_dir(Path(run_dir) / REPORT_DIR)
    stacks = request_stacks(run_dir, out / "stacks", entries, stacks_wait_s)
    headline, text = summarize(stalled, stacks, out)
    summary = out / SUMMARY_FILE
    summary.write_text(text)
    return HangError(f"{headline}; the hang report, with every process's stacks: {summary}", summary)


def summarize(stalled: list[RpcTimeoutError], stacks: list[Stacks], out: Path) -> tuple[str, str]:
    """(the console's headline, the summary file's text) for the calls in ``stalled`` and what each worker's stack
    request got."""
    late = {e.address: e for e in stalled}
    silent = [s for s in stacks if s.entry.address in late and not s.answered]
    waiting = [s for s in stacks if s.entry.address in late and s.answered]
    others = [s for s in stacks if s.entry.address not in late]
    first = stalled[0]
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(first.started))
    call = f"{first.method} within {first.timeout_s:g} s (cluster.hang_timeout_s; called at {since})"
    if silent:
        headline = f"{_names(silent)} did not answer {call}, nor a request for its stacks"
    else:
        headline = f"{_names(waiting)} did not answer {call}; each answered a request for its stacks"
    lines = [f"hang report: {headline}", ""]
    lines += _section(SILENT, silent, out) + _section(WAITING, waiting, out)
    lines += _section("the run's other processes:", others, out)
    return headline, "\n".join(lines) + "\n"


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
