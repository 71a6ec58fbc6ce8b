"""What the job benchmarks share: run ``python -m hpcrl.main`` with overrides, read what it wrote, print tables.

A job runs as a user runs it, in its own process (and session, so that a stop reaches its whole tree);
``stop_when`` ends it early with SIGTERM, which the job turns into a clean shutdown of every worker. While it
runs, the CPU time of its whole process tree is sampled twice a second with the number of steps logged, so
a benchmark can tell how many cores the job kept busy during its steps.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
QUICK = ["rollout.prompts_per_step=8", "dataset.eval_size=16"]  # what --quick adds to every job


@dataclass
class JobResult:
    run_dir: Path
    process_s: float  # the command's wall time, start-up and shutdown included
    summary: dict[str, Any] | None  # the job's last JSON line; None when stopped early
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl, one dict per step
    stopped_s: float | None = None  # when ``stop_when`` held, from the command's start (0.5 s resolution)
    cpu: list[tuple[float, float, int]] = field(default_factory=list)  # (time, tree CPU seconds, steps logged)
    started: float = 0.0  # the command's start, time.monotonic()

    def logged_s(self, steps: int) -> float | None:
        """When ``metrics.jsonl`` first held ``steps`` lines, from the command's start (0.5 s resolution), or None."""
        return next((at - self.started for at, _, logged in self.cpu if logged >= steps), None)

    def steps_s(self) -> float:
        """Wall time of the train steps (rollout wait + train + weight sync), evaluations and start-up excluded."""
        return sum(m["time_step_s"] for m in self.metrics)

    def cpu_s_per_step(self, upto: int) -> float:
        """CPU seconds of the job's process tree per step from its first logged step to step ``upto`` (steps
        2..upto, at the 0.5 s samples' resolution), or NaN with fewer than two samples between them."""
        first = next((s for s in self.cpu if s[2] >= 1), None)
        end = next((s for s in self.cpu if s[2] >= upto), None)
        if first is None or end is None or end[2] <= first[2]:
            return float("nan")
        return (end[1] - first[1]) / (end[2] - first[2])

    def cores_busy(self) -> float:
        """CPU seconds per second of the job's process tree from its first logged step to its last (steps 2..N)."""
        last = max((n for _, _, n in self.cpu), default=0)
        first = next((s for s in self.cpu if s[2] >= 1), None)
        end = next((s for s in self.cpu if s[2] == last), None)
        if first is None or end is None or end[0] <= first[0]:
            return float("nan")
        return (end[1] - first[1]) / (end[0] - first[0])


def run_job(
    overrides: Sequence[str],
    root: Path,
    trial: str,
    timeout_s: float = 1800,
    stop_when: Callable[[list[dict[str, Any]]], bool] | None = None,
    argv: Sequence[str] = ("-m", "hpcrl.main"),
    env: dict[str, str] | None = None,
) -> JobResult:
    """Run one job to its end (or until ``stop_when(metrics)`` holds); raise with its output if it failed."""
    run_dir = root / "bench" / trial
    cmd = [sys.executable, *argv, f"run.root={root}", "run.experiment=bench", f"run.trial={trial}", *overrides]
    out_file = root / f"{trial}.out"
    start = time.monotonic()
    with out_file.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        cpu: list[tuple[float, float, int]] = []
        stopped = _watch(proc, run_dir / "metrics.jsonl", start, timeout_s, stop_when, cpu)
    process_s = time.monotonic() - start
    text = out_file.read_text()
    if proc.returncode != 0 and stopped is None:
        raise RuntimeError(f"{' '.join(cmd)}\nexited with {proc.returncode}; last output:\n{text[-3000:]}")
    summary = json.loads(text.strip().splitlines()[-1]) if stopped is None else None
    return JobResult(run_dir, process_s, summary, read_metrics(run_dir / "metrics.jsonl"), stopped, cpu, start)


def _watch(proc: subprocess.Popen, metrics_file: Path, start: float, timeout_s: float, stop_when, cpu) -> float | None:
    """Wait for ``proc``, appending CPU samples to ``cpu``; SIGTERM it once ``stop_when`` holds (return when, from
    ``start``) or at the timeout (raise)."""
    while proc.poll() is None:
        now = time.monotonic()
        if now - start > timeout_s:
            _stop(proc)
            raise TimeoutError(f"job pid {proc.pid} still running after {timeout_s} s; stopped")
        metrics = read_metrics(metrics_file)
        cpu.append((now, _tree_cpu_s(proc.pid), len(metrics)))
        if stop_when is not None and stop_when(metrics):
            _stop(proc)
            return now - start
        time.sleep(0.5)
    return None


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (those that ended and were reaped count in
    their parent's children_* times)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # the job ends its workers' process trees itself
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session, started above
        proc.wait()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return rows


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table, columns padded; numbers right-aligned."""
    cells = [[str(h) for h in header], *[[_fmt(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [
        any(_is_number(row[i]) for row in rows) and all(_is_number(row[i]) or row[i] == "" for row in rows)
        for i in range(len(header))
    ]

    def line(row: list[str]) -> str:
        padded = (c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
