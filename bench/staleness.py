"""Steps and wall time to a held-out accuracy as rollouts grow stale, without and with each off-policy correction.

    python bench/staleness.py [--tasks default multi_turn] [--staleness 0 1 2 4]
        [--corrections none decoupled tis mis_token mis_sequence icepop] [--seeds 0 1 2] [--target 0.9]
        [--max-steps 200] [--quick] [-- OVERRIDE ...]

The claim tested is AReaL's: with staleness up to 4, decoupled PPO matches synchronous quality. Each cell (task x
``rollout.max_staleness`` x correction) runs the job once per seed with the default algorithm (``grpo``),
evaluated every 5 steps, until held-out greedy accuracy reaches ``--target`` (``eval.stop_at_accuracy``) or the
step budget runs out. Tasks: ``default`` (the mod10 task) and ``multi_turn`` (``experiment=mod10_multi_turn``).
Corrections: ``none``; ``decoupled`` (decoupled PPO, ``algorithm.behavior_weight_cap=5`` as the README's learning
run has it); ``tis``, ``mis_token``, ``mis_sequence``, ``icepop`` (``algorithm.off_policy.kind``, with that
setting's own defaults for its cap or band).

Per seed: the step of the first evaluation at the target ("-" if none within the budget), the wall time to it,
the accuracy the job ended with, the steps it ran and the mean ``off_policy_masked_frac`` over them (the share of
loss tokens the masked corrections, ``mis_token`` and ``mis_sequence``, took out; "-" where the metric is absent,
as for every other correction). The wall time is the sum of the steps' ``time_step_s``
(rollout wait + train + weight sync) from step 1 through that step: metrics.jsonl has no timestamps, and this
leaves out start-up and the held-out evaluations (during which the next batch's generation may go on, so the
step after one waits less). Per cell: the seeds at the target and the median
step and wall time over all its seeds, a seed that missed the target counting as beyond the budget (so the
median is "-" when half or more missed), and the mean masked fraction over all its seeds' steps. With
``max_staleness > 0`` which weights sample a token depends on timing: runs of a seed differ, and the machine's load
moves the wall time. ``-- OVERRIDE ...`` goes to every job.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _jobs import QUICK, JobResult, run_job, table

TASKS = {"default": [], "multi_turn": ["experiment=mod10_multi_turn"]}
OFF_POLICY = ("tis", "mis_token", "mis_sequence", "icepop")  # algorithm.off_policy.kind's corrections
CORRECTIONS = ("none", "decoupled", *OFF_POLICY)
DECOUPLED_CAP = 5  # AReaL's cap on the behaviour importance weight, as the README's decoupled PPO run uses
EVAL_EVERY = 5


@dataclass(frozen=True)
class Outcome:
    """One job: the step of its first evaluation at the target and the wall time to it (None: not reached)."""

    step: int | None
    wall_s: float | None
    accuracy: float  # held-out accuracy the job ended with (at the target step when it stopped there)
    steps_run: int
    masked_fracs: tuple[float, ...] = ()  # off_policy_masked_frac of each step that logged it (mis_* corrections)


def cell_overrides(task: str, staleness: int, correction: str) -> list[str]:
    """The overrides of one cell (task, ``rollout.max_staleness``, correction); raises on an unknown name."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: expected one of {', '.join(TASKS)}")
    if correction not in CORRECTIONS:
        raise ValueError(f"correction {correction!r}: expected one of {', '.join(CORRECTIONS)}")
    if staleness < 0:
        raise ValueError(f"staleness {staleness}: expected an integer >= 0")
    overrides = [*TASKS[task], f"rollout.max_staleness={staleness}"]
    if correction == "decoupled":
        overrides.append(f"algorithm.behavior_weight_cap={DECOUPLED_CAP}")
    elif correction in OFF_POLICY:
        overrides.append(f"algorithm.off_policy.kind={correction}")
    return overrides


def to_target(metrics: Sequence[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    """The step of the first evaluation at ``target`` or above, and the sum of ``time_step_s`` over steps 1 to it
    (the lines in step order); (None, None) when no evaluation reached it."""
    step = next((m["step"] for m in metrics if m.get("eval_accuracy", -1.0) >= target), None)
    if step is None:
        return None, None
    return step, sum(m["time_step_s"] for m in metrics if m["step"] <= step)


def outcome(job: JobResult, target: float) -> Outcome:
    step, wall_s = to_target(job.metrics, target)
    accuracy = (job.summary or {}).get("eval_accuracy_after", math.nan)
    masked = tuple(m["off_policy_masked_frac"] for m in job.metrics if "off_policy_masked_frac" in m)
    return Outcome(step, wall_s, accuracy, len(job.metrics), masked)


def mean_masked(outcomes: Sequence[Outcome]) -> float | None:
    """The mean ``off_policy_masked_frac`` over every step of ``outcomes`` that logged it; None where none did."""
    values = [v for o in outcomes for v in o.masked_fracs]
    return sum(values) / len(values) if values else None


def censored_median(values: Sequence[float | None]) -> float | None:
    """The median with None (target not reached) counted as beyond every reached value; None when the median
    falls on (or, for an even count, next to) a missed seed, or with no values."""
    if not values:
        return None
    ranked = sorted(math.inf if v is None else v for v in values)
    mid = len(ranked) // 2
    median = ranked[mid] if len(ranked) % 2 else (ranked[mid - 1] + ranked[mid]) / 2
    return None if math.isinf(median) else median


def seed_row(cell: tuple[str, int, str], seed: int, o: Outcome) -> list[Any]:
    return [*cell, seed, _dash(o.step), _dash(o.wall_s), o.accuracy, o.steps_run, _dash(mean_masked([o]))]


def cell_row(cell: tuple[str, int, str], outcomes: Sequence[Outcome]) -> list[Any]:
    """The cell's summary: seeds at the target (k/n), median step and median wall time (censored_median), mean
    masked fraction (mean_masked)."""
    reached = sum(o.step is not None for o in outcomes)
    steps = censored_median([o.step for o in outcomes])
    walls = censored_median([o.wall_s for o in outcomes])
    return [*cell, f"{reached}/{len(outcomes)}", _dash(steps), _dash(walls), _dash(mean_masked(outcomes))]


def _dash(value: float | None) -> Any:
    return "-" if value is None else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=CORRECTIONS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 steps of each, small batches")
    parser.add_argument("overrides", nargs="*", help="overrides for every job, after --")
    args = parser.parse_args()
    if any(s < 0 for s in args.staleness):
        parser.error(f"--staleness {args.staleness}: expected integers >= 0")
    steps = 2 if args.quick else args.max_steps
    common = [f"run.max_steps={steps}", f"eval.every_steps={EVAL_EVERY}", f"eval.stop_at_accuracy={args.target}"]
    common += (QUICK if args.quick else []) + args.overrides
    root = Path(tempfile.mkdtemp(prefix="hpcrl-staleness-"))
    seed_rows, cell_rows = [], []
    try:
        for task in args.tasks:
            for staleness in args.staleness:
                for correction in args.corrections:
                    cell = (task, staleness, correction)
                    outcomes = []
                    for seed in args.seeds:
                        trial = f"{task}-s{staleness}-{correction}-{seed}"
                        overrides = [*cell_overrides(*cell), f"run.seed={seed}", *common]
                        o = outcome(run_job(overrides, root, trial), args.target)
                        outcomes.append(o)
                        seed_rows.append(seed_row(cell, seed, o))
                        wall = "-" if o.wall_s is None else f"{o.wall_s:.1f} s"
                        print(f"{trial}: target at step {_dash(o.step)} ({wall}), {o.steps_run} steps run", flush=True)
                    cell_rows.append(cell_row(cell, outcomes))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nsteps and wall time to held-out accuracy {args.target} (budget {steps} steps, evaluated every "
          f"{EVAL_EVERY}; wall = sum of time_step_s to that step)")  # fmt: skip
    cell = ["task", "max_staleness", "correction"]
    print(table([*cell, "seed", f"step at {args.target}", "wall s", "accuracy", "steps run", "masked frac"], seed_rows))
    print()
    print(table([*cell, "seeds at target", "median step", "median wall s", "masked frac"], cell_rows))


if __name__ == "__main__":
    main()
