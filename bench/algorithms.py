"""Steps to a held-out accuracy: PPO with a critic, GRPO and the critic-free REINFORCE++ on the same seeds.

    python bench/algorithms.py [--seeds 0 1] [--target 0.9] [--max-steps 200] [--quick] [-- OVERRIDE ...]

Each algorithm (``algorithm=ppo``, ``grpo``, ``reinforce_pp``; ``--algorithms`` also takes ``dr_grpo`` and ``dapo``)
runs the default task once per seed, evaluated every 5 steps, until held-out greedy accuracy reaches ``--target``
(``eval.stop_at_accuracy``) or the step budget runs out. The measure is steps, not seconds: synchronous rollout with
seeded sampling repeats closely whatever else runs on the machine. Reported per algorithm and seed: the step of the
first evaluation at the target ("-" if none within the budget), the accuracy reached, the samples trained on to get
there (steps x prompts x group size: the presets' group sizes differ), and for PPO the critic's explained variance,
mean over the first and the last 10 steps. ``-- OVERRIDE ...`` goes to every job (e.g.
``workflow.name=multi_turn``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import yaml
from _jobs import QUICK, JobResult, run_job, table

ALGORITHMS = ("ppo", "grpo", "reinforce_pp")  # the default; --algorithms takes any preset
PRESETS = ("ppo", "grpo", "reinforce_pp", "dr_grpo", "dapo")


def reached(job: JobResult, target: float) -> int | None:
    """The step of the first evaluation at ``target`` or above, or None."""
    return next((m["step"] for m in job.metrics if m.get("eval_accuracy", -1.0) >= target), None)


def samples_per_step(job: JobResult) -> int:
    """Prompts per step x group size, from the run's own config.yaml."""
    cfg = yaml.safe_load((job.run_dir / "config.yaml").read_text())
    return int(cfg["rollout"]["prompts_per_step"]) * int(cfg["algorithm"]["group_size"])


def explained_variance(job: JobResult) -> tuple[float, float]:
    """The critic's explained variance, mean over the first 10 and the last 10 steps (NaN without a critic)."""
    values = [m["critic_explained_var"] for m in job.metrics if "critic_explained_var" in m]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values[:10]), statistics.fmean(values[-10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=PRESETS)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 steps of each, small batches")
    parser.add_argument("overrides", nargs="*", help="overrides for every job, after --")
    args = parser.parse_args()
    steps = 2 if args.quick else args.max_steps
    common = [f"run.max_steps={steps}", "eval.every_steps=5", f"eval.stop_at_accuracy={args.target}"]
    common += (QUICK if args.quick else []) + args.overrides
    root = Path(tempfile.mkdtemp(prefix="hpcrl-algorithms-"))
    rows = []
    try:
        for algorithm in args.algorithms:
            for seed in args.seeds:
                job = run_job([f"algorithm={algorithm}", f"run.seed={seed}", *common], root, f"{algorithm}-{seed}")
                summary = job.summary or {}
                step = reached(job, args.target)
                per_step = samples_per_step(job)
                first, last = explained_variance(job)
                rows.append([
                    algorithm, seed, "-" if step is None else step, summary.get("eval_accuracy_after", float("nan")),
                    len(job.metrics), per_step * (step or len(job.metrics)), first, last,
                ])  # fmt: skip
                print(f"{algorithm} seed {seed}: target at step {step}, {len(job.metrics)} steps run", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    header = ["algorithm", "seed", f"step at {args.target}", "accuracy", "steps run", "samples", "EV first 10",
              "EV last 10"]  # fmt: skip
    print(f"\nsteps to held-out accuracy {args.target} (budget {steps} steps, evaluated every 5)")
    print(table(header, rows))


if __name__ == "__main__":
    main()
