"""Controller overhead: the share of each train step when neither generation nor training runs.

    python bench/controller_overhead.py [--runs 3] [--steps 20] [--staleness 0 1] [--quick] [-- OVERRIDE ...]

Runs the default job (``eval.stop_at_accuracy=0 eval.every_steps=0``) through ``bench/_timeline.py``, which
records in the controller, on one wall clock, when each step ran and when a generate request, a train-step
RPC, a weight push or a reward call was under way. A step's time runs from its start (``Loop._step``: rollout
wait, train, weight sync) to the next step's start, so the loop's work between steps (the metrics line,
TensorBoard, the progress line) is in it; the last step's ends with it. It splits into:

- generation or training: some generate request in flight, or a train-step RPC;
- weight sync only: the servers paused for a weight push, nothing else running;
- controller: none of these; the controller alone (the last groups' reward calls, building and sharding the
  batch, encoding RPCs, the event loop's own scheduling). ``reward`` is the part of it in reward calls.

``judge`` is apart from these: the time a request to the reward model's servers was in flight (a judge's batch,
``experiment=mod10_judge``), wherever it fell in the step; 0 without a reward model.

"neither" = weight sync only + controller: the issue's measure, goal < 5% of the step. Shares are of the sum
of all steps of a job; medians over runs. The timings are the controller's view: a request counts as
generation from its send to its answer, so "controller" is a lower bound on the time the servers sit idle.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
from pathlib import Path

from _jobs import QUICK, median, run_job, table

FIXED = ["eval.stop_at_accuracy=0", "eval.every_steps=0"]
TIMELINE = str(Path(__file__).resolve().parent / "_timeline.py")


def union_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of ``intervals`` clipped to [lo, hi], as sorted disjoint intervals."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    merged: list[tuple[float, float]] = []
    for a, b in clipped:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def split_steps(timeline: list) -> dict[str, float]:
    """Seconds of every step of a job, summed: total, generation-or-training, sync only, controller, reward."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for kind, start, end, _ in timeline:
        by_kind.setdefault(kind, []).append((start, end))
    out = dict.fromkeys(("total", "gen_or_train", "sync_only", "controller", "reward", "judge"), 0.0)
    for lo, hi in step_windows(by_kind["step"]):
        gen_train = union_within(by_kind.get("gen", []) + by_kind.get("train", []), lo, hi)
        busy = union_within(gen_train + by_kind.get("sync", []), lo, hi)
        reward = union_within(by_kind.get("reward", []), lo, hi)
        out["total"] += hi - lo
        out["gen_or_train"] += length(gen_train)
        out["sync_only"] += length(busy) - length(gen_train)
        out["controller"] += (hi - lo) - length(busy)
        out["reward"] += length(union_within(reward + busy, lo, hi)) - length(busy)  # reward calls alone
        out["judge"] += length(union_within(by_kind.get("judge", []), lo, hi))
    return out


def step_windows(steps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each step from its start to the next step's start (the last: to its end)."""
    steps = sorted(steps)
    return [(a, nxt) for (a, _), (nxt, _) in itertools.pairwise(steps)] + steps[-1:]


PARTS = ("sync", "export", "load", "pause")  # a push and its parts, timed in the controller


def push_parts_ms(timeline: list) -> dict[str, float]:
    """Median ms a step of a push and of each of its parts (the intervals that fall within a step; a step
    without one counts as 0)."""
    steps = [(start, end) for kind, start, end, _ in timeline if kind == "step"]
    out = {}
    for part in PARTS:
        spans = [(start, end) for kind, start, end, _ in timeline if kind == part]
        per_step = [sum(b - a for a, b in spans if a >= lo and b <= hi) for lo, hi in steps]
        out[part] = 1000 * median(per_step)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--quick", action="store_true", help="2 steps of 8 prompts, one run, staleness 0 (smoke)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("overrides", nargs="*", help="more hpcrl.main overrides, for every job")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.steps, args.staleness, args.overrides = 1, 2, [0], [*QUICK, *args.overrides]
    root = Path(tempfile.mkdtemp(prefix="hpcrl-bench-overhead-"))
    results: dict[int, list[dict[str, float]]] = {s: [] for s in args.staleness}
    try:
        for r in range(args.runs):
            for s in args.staleness:
                trial = f"run{r}-staleness{s}"
                out = root / f"{trial}.timeline.json"
                overrides = [*FIXED, f"run.max_steps={args.steps}", f"rollout.max_staleness={s}", *args.overrides]
                run_job(overrides, root, trial, argv=[TIMELINE, str(out)])
                timeline = json.loads(out.read_text())
                results[s].append(split_steps(timeline) | {f"{k}_ms": v for k, v in push_parts_ms(timeline).items()})
                last = results[s][-1]
                shares = {k: round(v / last["total"], 3) for k, v in last.items() if not k.endswith("_ms")}
                ms = {k: round(v, 1) for k, v in last.items() if k.endswith("_ms")}
                print(f"run {r + 1}/{args.runs} staleness {s}: shares {shares}, ms {ms}", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(results, args)


def report(results: dict[int, list[dict[str, float]]], args) -> None:
    def share(s: int, key: str) -> float:
        return median([r[key] / r["total"] for r in results[s]])

    rows = []
    for s, runs in results.items():
        neither = [(r["sync_only"] + r["controller"]) / r["total"] for r in runs]
        rows.append(
            [
                f"max_staleness={s}",
                median([r["total"] / args.steps for r in runs]),
                share(s, "gen_or_train"),
                share(s, "sync_only"),
                share(s, "controller"),
                share(s, "reward"),
                share(s, "judge"),
                median(neither),
                ", ".join(f"{v:.3f}" for v in neither),
            ]
        )
    print(f"{args.steps} steps per job, median of {args.runs} runs; shares of the steps' wall time")
    header = [
        "job",
        "s/step",
        "gen or train",
        "weight sync",
        "controller",
        "(reward)",
        "judge",
        "neither",
        "neither, each run",
    ]
    print(table(header, rows))
    parts = [
        [f"max_staleness={s}", *(median([r[f"{k}_ms"] for r in runs]) for k in PARTS)] for s, runs in results.items()
    ]
    print("a step's weight push and its parts, ms (median of the steps, then of the runs; in the controller)")
    print(table(["job", "push", "export", "load", "pause+continue"], parts))
    for s, runs in results.items():
        neither = median([(r["sync_only"] + r["controller"]) / r["total"] for r in runs])
        controller = share(s, "controller")
        print(
            f"max_staleness={s}: neither generation nor training {neither:.1%} of the step (goal < 5%): "
            f"{'met' if neither < 0.05 else 'missed'}; controller alone {controller:.1%}"
        )


if __name__ == "__main__":
    main()
