"""hpcrl against TRL's GRPOTrainer: wall-clock to a mean training reward of 0.8 on the mod10 task.

    python bench/trl_grpo.py [--runs 3] [--max-steps 150] [--time-cap-s 600] [--target 0.8] [--also 0.9]
                             [--staleness 0 1] [--trl-threads N] [--quick]

Needs TRL in the venv (only for this benchmark): ``pip install trl==1.16.0`` (with transformers 5.x).

The same start for both, per run (seed = run index): the default job's tiny model (Qwen2, hidden 128, 2
layers, 4 heads, MLP 512, the mod10 alphabet ``+0123456789=``), made once with ``make_tiny_model`` and loaded
by both from the same directory (hpcrl: ``model=local``); the same rows (``make_mod10(2000, 200, seed)``'s
training split) and reward (``hpcrl.reward.builtin:mod10``). Both with the default job's settings: 64 prompts x
8 completions a step (group size 8), at most 2 new tokens, temperature 1, AdamW lr 5e-4 constant, grad clip
1.0, clip 0.2, no KL, group mean/std advantages, per-sequence token mean loss, and 2 optimizer updates of 256
completions on each batch of 512, drawn from the batch shuffled (TRL: ``per_device_train_batch_size=256,
steps_per_generation=2``, ``loss_type="grpo"``, which shuffles the batch before splitting it; hpcrl:
``algorithm.shuffle_minibatches=true``; its "reward" is logged once per generation batch with ``logging_steps=2``).

hpcrl runs as ``python -m hpcrl.main`` (the default allocation: one CPU server, one trainer rank); TRL runs in one
process (this script with ``--trl-run``: CPU, no vLLM, generation with ``model.generate``). Each is stopped as soon as
a step's mean reward over its 512 completions reaches ``--target``, or at ``--max-steps`` steps (a step =
one batch of 512 = 2 optimizer updates) or ``--time-cap-s``. Reported: steps and seconds to the target,
training only (hpcrl: the steps' ``time_step_s``; TRL: from ``on_train_begin``) and from the command's start;
the CPU seconds a step from the first logged step to the target's (hpcrl: its process tree's, sampled twice a
second; TRL: its process's), and from hpcrl's the CPU bound: its CPU seconds a step spread over this machine's cores,
the shortest its step could be doing the same work with no core ever idle, against TRL's measured step.
``--also`` adds targets (e.g. 0.9) that each run goes on to: the steps to each, per seed, with their median and
range; the ratios stay those of ``--target``, which come from the same runs. ``--staleness`` runs hpcrl once per
value of ``rollout.max_staleness`` on each seed (default 0 only: synchronous, as TRL is), each against the same TRL
run; with staleness above 0 generation overlaps training and the samples may be that many versions old.
TRL runs with torch's default threads (one per core) unless ``--trl-threads`` says otherwise: a 2-thread
process slows several-fold on a machine whose cores others are using.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _jobs import median, run_job, table
from _trl import ALPHABET, GROUP, LR, PROMPTS, TINY, make_trainer, trl_config

# --- TRL, in its own process ----------------------------------------------------------------------------


def trl_run(model_dir: str, seed: int, prompts: int, max_steps: int, time_cap_s: float, target: float, out: str):
    started = time.time()
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    record: dict = {"started": started, "log": []}

    class Stop(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            record["train_begin"] = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                now = time.time()
                record["log"].append((state.global_step // 2, logs["reward"], now, time.process_time()))
                if logs["reward"] >= target or now - record["train_begin"] > time_cap_s:  # the highest target
                    control.should_training_stop = True

    config = trl_config(Path(out).parent / f"trl-{seed}", seed, prompts, max_steps)
    make_trainer(GRPOTrainer, model_dir, seed, config, [Stop()]).train()
    Path(out).write_text(json.dumps(record))


def run_trl(model_dir: Path, seed: int, args, work: Path) -> dict:
    out = work / f"trl-{seed}.json"
    cmd = [sys.executable, __file__, "--trl-run", str(model_dir), str(seed), str(args.prompts), str(args.max_steps)]
    cmd += [str(args.time_cap_s), str(max(targets(args))), str(out)]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.trl_threads)} if args.trl_threads else {})}
    spawned = time.time()
    with (work / f"trl-{seed}.out").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.time_cap_s + 600)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed ({proc.returncode}): {(work / f'trl-{seed}.out').read_text()[-3000:]}")
    record = json.loads(out.read_text())
    log_ = record["log"]
    hit = next((row for row in log_ if row[1] >= args.target), None)
    return {
        "reached": hit is not None,
        "steps": hit[0] if hit else log_[-1][0],
        "train_s": (hit[2] if hit else log_[-1][2]) - record["train_begin"],
        "command_s": (hit[2] if hit else log_[-1][2]) - spawned,
        "last_reward": log_[-1][1],
        "steps_to": {t: next((row[0] for row in log_ if row[1] >= t), None) for t in targets(args)},
        "cpu_step": trl_cpu_s_per_step(log_, hit),
    }


def trl_cpu_s_per_step(log_: list, hit: list | None) -> float:
    """The TRL process's CPU seconds (every thread's) per step from its first logged step to the target's, or to
    its last when it missed; NaN with one logged step."""
    first, end = log_[0], hit or log_[-1]
    return (end[3] - first[3]) / (end[0] - first[0]) if end[0] > first[0] else float("nan")


# --- hpcrl ----------------------------------------------------------------------------------------------


def hpcrl_overrides(model_dir: Path, seed: int, max_steps: int, prompts: int) -> list[str]:
    """The job on ``model_dir`` with the settings TRL gets here; no early stop, no held-out evaluation."""
    return [
        "model=local",
        f"model.path={model_dir}",
        "model.dtype=float32",
        f"run.seed={seed}",
        f"run.max_steps={max_steps}",
        f"rollout.prompts_per_step={prompts}",
        f"algorithm.group_size={GROUP}",
        f"train.lr={LR}",
        "algorithm.shuffle_minibatches=true",  # TRL shuffles its generation batch before splitting it in two
        "eval.stop_at_accuracy=0",
        "eval.every_steps=0",
    ]


def hpcrl_name(staleness: int) -> str:
    return "hpcrl" if staleness == 0 else f"hpcrl staleness {staleness}"


def run_hpcrl(model_dir: Path, seed: int, args, work: Path, staleness: int = 0) -> dict:
    def reached(metrics) -> bool:
        return any(m["reward_mean"] >= max(targets(args)) for m in metrics)

    start = time.monotonic()

    def stop(metrics) -> bool:  # the target, or the time cap (the step cap is run.max_steps)
        elapsed = sum(m["time_step_s"] for m in metrics)
        return reached(metrics) or elapsed > args.time_cap_s or time.monotonic() - start > args.time_cap_s + 300

    overrides = hpcrl_overrides(model_dir, seed, args.max_steps, args.prompts)
    overrides += ["dataset.eval_size=16"] if args.quick else []
    overrides += [f"rollout.max_staleness={staleness}"] if staleness else []
    job = run_job(overrides, work, f"hpcrl-{seed}-s{staleness}", timeout_s=args.time_cap_s + 900, stop_when=stop)
    metrics = job.metrics
    hit = next((i for i, m in enumerate(metrics) if m["reward_mean"] >= args.target), None)
    upto = metrics[: hit + 1] if hit is not None else metrics
    return {
        "reached": hit is not None,
        "steps": len(upto),
        "train_s": sum(m["time_step_s"] for m in upto),
        "command_s": job.logged_s(len(upto)) if hit is not None else job.process_s,
        "last_reward": upto[-1]["reward_mean"],
        "steps_to": {t: next((m["step"] for m in metrics if m["reward_mean"] >= t), None) for t in targets(args)},
        "cpu_step": job.cpu_s_per_step(len(upto)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=150, help="step cap of each run (a step = 512 samples)")
    parser.add_argument("--time-cap-s", type=float, default=600, help="training time cap of each run")
    parser.add_argument("--target", type=float, default=0.8, help="mean training reward of one step")
    parser.add_argument("--also", type=float, nargs="*", default=[], help="more targets to record steps to")
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per step (x 8 completions)")
    parser.add_argument("--trl-threads", type=int, default=0, help="TRL's torch threads; 0 = torch's default")
    parser.add_argument(
        "--staleness", type=int, nargs="+", default=[0], help="hpcrl's rollout.max_staleness, a run of each per seed"
    )
    parser.add_argument("--quick", action="store_true", help="2 steps of 8 prompts, one run (smoke test)")
    parser.add_argument("--trl-run", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_run:
        m, seed, prompts, steps, cap, target, out = args.trl_run
        return trl_run(m, int(seed), int(prompts), int(steps), float(cap), float(target), out)
    if args.quick:
        args.runs, args.max_steps, args.prompts = 1, 2, 8
    from hpcrl.models.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-trl-"))
    results: dict[str, list[dict]] = {**{hpcrl_name(s): [] for s in args.staleness}, "trl": []}
    try:
        for seed in range(args.runs):
            model_dir = make_tiny_model(work / f"model-{seed}", seed=seed, characters=ALPHABET, **TINY)
            for staleness in args.staleness:
                name = hpcrl_name(staleness)
                results[name].append(run_hpcrl(model_dir, seed, args, work, staleness))
                print(f"seed {seed} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
            results["trl"].append(run_trl(model_dir, seed, args, work))
            print(f"seed {seed} trl: {results['trl'][-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, args)


def report(results: dict[str, list[dict]], args) -> None:
    print(
        f"to mean training reward >= {args.target}; {args.prompts} prompts x {GROUP} a step; caps {args.max_steps} "
        f"steps, {args.time_cap_s:.0f} s; median of {args.runs} runs (seeds 0..{args.runs - 1}); TRL threads "
        f"{args.trl_threads or 'default'}"
    )
    rows = []
    for name, runs in results.items():
        rows.append(
            [
                name,
                f"{sum(r['reached'] for r in runs)}/{len(runs)}",
                median([r["steps"] for r in runs]),
                median([r["train_s"] for r in runs]),
                median([r["command_s"] for r in runs]),
                median([r["train_s"] / r["steps"] for r in runs]),
                median([r["cpu_step"] for r in runs]),
                ", ".join(f"{r['train_s']:.1f}" + ("" if r["reached"] else "*") for r in runs),
            ]
        )
    header = ["trainer", "reached", "steps", "train s", "command s", "s/step", "CPU s/step", "train s, each run"]
    print(table(header, rows))
    for name, runs in results.items():
        for seed, r in enumerate(runs):
            if not r["reached"]:
                print(
                    f"* {name} seed {seed} did not reach {args.target}: {r['steps']} steps, last reward "
                    f"{r['last_reward']:.3f}; its times are to the cap"
                )
    for name in (n for n in results if n != "trl"):
        pairs = list(zip(results["trl"], results[name], strict=True))
        ratio = median([t["train_s"] / h["train_s"] for t, h in pairs])
        command = median([t["command_s"] / h["command_s"] for t, h in pairs])
        reached = all(r["reached"] for runs in (results["trl"], results[name]) for r in runs)
        verdict = ("met" if ratio >= 1.5 else "missed") if reached else "not measured (a run missed the target)"
        print(
            f"TRL / {name} time to the target, training = {ratio:.2f} (goal >= 1.5): {verdict}; whole command = "
            f"{command:.2f} (goal >= 1.0)"
        )
        print(cpu_bound(results, name))
    print(steps_table(results, args))


def cpu_bound(results: dict[str, list[dict]], name: str = "hpcrl") -> str:
    """How fast hpcrl's step (the runs under ``name``) could be here doing the CPU work it does now with every core
    always busy, and the training ratio that step would give against TRL's measured step (medians over the runs)."""
    cores = len(os.sched_getaffinity(0))
    hpcrl_cpu = median([r["cpu_step"] for r in results[name]])
    trl_step = median([r["train_s"] / r["steps"] for r in results["trl"]])
    floor = hpcrl_cpu / cores
    return (
        f"CPU bound: {name}'s {hpcrl_cpu:.3f} CPU s a step over {cores} cores = {floor:.3f} s a step at best; TRL's "
        f"step {trl_step:.3f} s / that = {trl_step / floor:.2f}, the most TRL / hpcrl per step can be here without "
        "less CPU work a step"
    )


def targets(args) -> list[float]:
    return sorted({args.target, *args.also})


def steps_table(results: dict[str, list[dict]], args) -> str:
    """Steps to each target per trainer: every seed's, their median and range (``-``: not reached)."""
    rows = []
    for name, runs in results.items():
        for t in targets(args):
            steps = [r["steps_to"][t] for r in runs]
            reached = [n for n in steps if n is not None]
            spread = f"{min(reached)}-{max(reached)}" if reached else "-"
            each = ", ".join("-" if n is None else str(n) for n in steps)
            rows.append([name, t, f"{len(reached)}/{len(runs)}", median(reached) if reached else "-", spread, each])
    return table(["trainer", "target", "reached", "median steps", "range", "steps, seeds 0.."], rows)


if __name__ == "__main__":
    main()
