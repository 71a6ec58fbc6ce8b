"""Async against sync rollout: the default job with ``rollout.max_staleness`` 0, 1 and 2, side by side.

    python bench/async_pipeline.py [--runs 3] [--steps 20] [--staleness 0 1 2] [--quick] [-- OVERRIDE ...]

Each run starts the same job (task, model, seed, steps) once per staleness, one after the other, with
``eval.stop_at_accuracy=0 eval.every_steps=0`` so every job trains exactly ``--steps`` steps. From each job's
``metrics.jsonl``: the steps' wall time (sum of ``time_step_s``: rollout wait + train + weight sync; the
held-out evaluations before the first and after the last step are left out) and the summary's ``wall_s``.

The bound: a two-stage pipeline (generation | training + weight sync) takes, per step, the longer of the two
stages instead of their sum. Both are measured on the synchronous job of the same run, where nothing
overlaps: generation = ``time_rollout_wait_s``, training = ``time_train_s + time_sync_s``; bound = sum over
steps of max(generation, training). Goal: async steps time <= 1.15 x bound. Ratios are taken within a run
and reported as medians over runs.

That bound assumes each stage has hardware of its own. Beside it, the CPU bound of this machine: the CPU
seconds the synchronous job's process tree used during its steps (sampled, ``_jobs.JobResult.cores_busy``)
spread over every core, the shortest any overlap could make the steps if nothing else ran on the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from _jobs import QUICK, JobResult, median, run_job, table

FIXED = ["eval.stop_at_accuracy=0", "eval.every_steps=0"]


def cpu_bound(sync: JobResult) -> float:
    """The synchronous steps' CPU seconds over every core of the machine."""
    return sync.steps_s() * sync.cores_busy() / (os.cpu_count() or 1)


def stages(sync: JobResult) -> tuple[float, float, float]:
    """(sequential, pipeline bound, generation share) from the synchronous job's per-step timings."""
    gen = [m["time_rollout_wait_s"] for m in sync.metrics]
    train = [m["time_train_s"] + m["time_sync_s"] for m in sync.metrics]
    sequential = sum(g + t for g, t in zip(gen, train, strict=True))
    bound = sum(max(g, t) for g, t in zip(gen, train, strict=True))
    return sequential, bound, sum(gen) / sequential


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="2 steps of 8 prompts, one run (smoke test)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("overrides", nargs="*", help="more hpcrl.main overrides, for every job")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.steps, args.overrides = 1, 2, [*QUICK, *args.overrides]
    if 0 not in args.staleness:
        parser.error("--staleness must include 0: the bound is measured on the synchronous job")
    root = Path(tempfile.mkdtemp(prefix="hpcrl-bench-async-"))
    runs: list[dict[int, JobResult]] = []
    try:
        for r in range(args.runs):
            jobs = {}
            for s in args.staleness:
                overrides = [*FIXED, f"run.max_steps={args.steps}", f"rollout.max_staleness={s}", *args.overrides]
                jobs[s] = run_job(overrides, root, f"run{r}-staleness{s}")
                done = f"run {r + 1}/{args.runs} staleness {s}: steps {jobs[s].steps_s():.1f} s"
                print(f"{done}, {jobs[s].cores_busy():.2f} cores busy", file=sys.stderr, flush=True)
            runs.append(jobs)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(runs, args)


def report(runs: list[dict[int, JobResult]], args) -> None:
    bounds = [stages(jobs[0]) for jobs in runs]
    rows = []
    for s in args.staleness:
        steps = [jobs[s].steps_s() for jobs in runs]
        rows.append(
            [
                f"max_staleness={s}",
                median(steps),
                median([jobs[s].summary["wall_s"] for jobs in runs]),
                median([jobs[s].steps_s() / jobs[0].steps_s() for jobs in runs]),
                median([jobs[s].steps_s() / b[1] for jobs, b in zip(runs, bounds, strict=True)]),
                median([jobs[s].steps_s() / cpu_bound(jobs[0]) for jobs in runs]),
                median([jobs[s].cores_busy() for jobs in runs]),
                median([max(m["staleness_max"] for m in jobs[s].metrics) for jobs in runs]),
                ", ".join(f"{v:.1f}" for v in steps),
            ]
        )
    sync = "from the sync jobs"
    rows.append(["bound: sum(gen + train)", median([b[0] for b in bounds]), "", "", "", "", "", "", sync])
    rows.append(["bound: sum(max(gen, train))", median([b[1] for b in bounds]), "", "", 1.0, "", "", "", sync])
    rows.append(["bound: CPU-s / cores", median([cpu_bound(j[0]) for j in runs]), "", "", "", 1.0, "", "", sync])
    print(f"{args.steps} steps per job, median of {args.runs} runs; overrides: {' '.join(args.overrides) or 'none'}")
    header = ["job", "steps s", "wall_s", "/ sync", "/ pipeline bound", "/ CPU bound", "cores busy", "staleness seen"]
    header.append("steps s, each run")
    print(table(header, rows))
    share = median([b[2] for b in bounds])
    print(f"generation share of a sync step: {share:.2f} (training + weight sync: {1 - share:.2f})")
    best = min((s for s in args.staleness if s), default=None)
    if best is not None:
        ratio = median([jobs[best].steps_s() / b[1] for jobs, b in zip(runs, bounds, strict=True)])
        verdict = "met" if ratio <= 1.15 else "missed"
        print(f"max_staleness={best} / pipeline bound = {ratio:.2f} (goal <= 1.15): {verdict}")
        ratio = median([jobs[best].steps_s() / cpu_bound(jobs[0]) for jobs in runs])
        print(f"max_staleness={best} / CPU bound ({os.cpu_count()} cores) = {ratio:.2f}")


if __name__ == "__main__":
    main()
