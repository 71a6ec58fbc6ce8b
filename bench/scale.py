"""How a step's cost grows: hpcrl against TRL's GRPOTrainer as the model and the prompts per step grow.

    python bench/scale.py [--steps 4] [--plot bench/scale.png] [--quick]

Needs TRL in the venv, as ``bench/trl_grpo.py`` does (``pip install trl==1.16.0``).

Two sweeps on the mod10 task, each point one hpcrl job and one TRL run from the same model directory (made
with ``make_tiny_model``: Qwen2-shaped, the mod10 alphabet, seed 0) with ``trl_grpo.py``'s settings (group
of 8, at most 2 new tokens, lr 5e-4, 2 optimizer updates a batch; TRL through ``trl_grpo.py --trl-run``):

- the model grows (``SIZES``: 0.5M, 4M, 17M and 57M parameters) at the default 64 prompts a step;
- the prompts per step grow (``PROMPTS``: 16, 64, 256) with the default job's 0.5M-parameter model.

Each side runs ``--steps`` steps (a step = one batch of prompts x 8 = 2 optimizer updates; no stop at a
reward). Reported per point: the median time of a step after the first (hpcrl: ``time_step_s``; TRL: the
time between its reward logs, one per batch), both as s/step, and TRL / hpcrl (above 1: hpcrl is faster),
with the first size and prompt count where that ratio reaches 1, if one does. ``--plot`` writes both
curves to a PNG.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _jobs import median, run_job, table
from trl_grpo import ALPHABET, GROUP, hpcrl_overrides

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Size:
    name: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int = 4


SIZES = [
    Size("0.5M", 128, 2, 512),  # the default job's model (conf/model/tiny.yaml)
    Size("4M", 256, 4, 1024),
    Size("17M", 512, 4, 2048),
    Size("57M", 768, 6, 3072),
]
PROMPTS = [16, 64, 256]
DEFAULT_PROMPTS = 64


def make_model(size: Size, work: Path) -> tuple[Path, int]:
    """The model directory of ``size`` and its parameter count."""
    from safetensors.torch import load_file

    from hpcrl.models.tiny import make_tiny_model

    shape = dict(hidden_size=size.hidden_size, num_layers=size.num_layers, num_heads=size.num_heads)
    path = make_tiny_model(work / f"model-{size.name}", characters=ALPHABET, intermediate_size=size.intermediate_size,
                           **shape)  # fmt: skip
    return path, sum(t.numel() for t in load_file(path / "model.safetensors").values())  # the tied head once


def hpcrl_step_s(model_dir: Path, prompts: int, steps: int, work: Path, trial: str) -> float:
    """Median ``time_step_s`` of steps 2..N of one hpcrl job."""
    overrides = [*hpcrl_overrides(model_dir, 0, steps, prompts), "dataset.eval_size=16"]
    job = run_job(overrides, work, trial, timeout_s=3600)
    times = [m["time_step_s"] for m in job.metrics]
    return median(times[1:] or times)


def trl_step_s(model_dir: Path, prompts: int, steps: int, work: Path, trial: str) -> float:
    """Median time between TRL's reward logs (one per batch) after the first, from ``trl_grpo.py --trl-run``."""
    out = work / f"{trial}.json"
    # target 2: a mean reward never reaches it, so the run goes on to its step cap
    cmd = [sys.executable, str(BENCH / "trl_grpo.py"), "--trl-run", str(model_dir), "0", str(prompts), str(steps)]
    cmd += ["3600", "2", str(out)]
    with (work / f"{trial}.out").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed ({proc.returncode}): {(work / f'{trial}.out').read_text()[-3000:]}")
    stamps = [row[2] for row in json.loads(out.read_text())["log"]]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    if not gaps:
        raise RuntimeError(f"TRL logged {len(stamps)} batch(es) in {trial}; --steps must be at least 2")
    return median(gaps)


def measure(points: list[tuple[Size, int]], steps: int, work: Path) -> list[dict]:
    rows, models = [], {}
    for size, prompts in points:
        if size.name not in models:
            models[size.name] = make_model(size, work)
        model_dir, params = models[size.name]
        trial = f"{size.name}-p{prompts}"
        started = time.monotonic()
        hpcrl = hpcrl_step_s(model_dir, prompts, steps, work, f"hpcrl-{trial}")
        trl = trl_step_s(model_dir, prompts, steps, work, f"trl-{trial}")
        rows.append({"size": size.name, "params": params, "prompts": prompts, "hpcrl": hpcrl, "trl": trl})
        print(f"{trial}: hpcrl {hpcrl:.3f} s/step, TRL {trl:.3f} s/step ({time.monotonic() - started:.0f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
    return rows


def report(rows: list[dict], title: str, key: str) -> None:
    print(title)
    header = ["model", "params", "prompts x 8", "hpcrl s/step", "TRL s/step", "TRL / hpcrl"]
    print(table(header, [[r["size"], r["params"], r["prompts"], r["hpcrl"], r["trl"], r["trl"] / r["hpcrl"]]
                         for r in rows]))  # fmt: skip
    crossing = next((r for r in rows if r["trl"] / r["hpcrl"] >= 1), None)
    where = f"at {key} {crossing['size' if key == 'model' else 'prompts']}" if crossing else "at none of these sizes"
    print(f"hpcrl's step is at least as fast as TRL's {where}")


def plot(by_size: list[dict], by_prompts: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, rows, x, label in ((axes[0], by_size, "params", "parameters (64 prompts x 8)"),
                               (axes[1], by_prompts, "prompts", "prompts per step x 8 (0.5M parameters)")):  # fmt: skip
        xs = [r[x] for r in rows]
        ax.plot(xs, [r["hpcrl"] for r in rows], "o-", label="hpcrl")
        ax.plot(xs, [r["trl"] for r in rows], "s--", label="TRL GRPOTrainer")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("s / step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Step time as the work grows (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps of each run (the first is not timed)")
    parser.add_argument("--plot", type=Path, default=None, help="write both curves to this PNG")
    parser.add_argument("--quick", action="store_true", help="the two smallest points, 2 steps, 8 prompts")
    args = parser.parse_args()
    sizes, prompts, default_prompts = SIZES, PROMPTS, DEFAULT_PROMPTS
    if args.quick:
        sizes, prompts, default_prompts, args.steps = SIZES[:2], [8], 8, 2
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-scale-"))
    try:
        by_size = measure([(s, default_prompts) for s in sizes], args.steps, work)
        known = {r["prompts"]: r for r in by_size if r["size"] == sizes[0].name}
        by_prompts = [known.get(p) or measure([(sizes[0], p)], args.steps, work)[0] for p in prompts]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"median s/step of steps 2..{args.steps}; TRL / hpcrl above 1: hpcrl is faster")
    report(by_size, f"the model grows ({default_prompts} prompts x {GROUP} a step)", "model")
    report(by_prompts, f"the prompts grow (the {sizes[0].name} model)", "prompts")
    if args.plot:
        plot(by_size, by_prompts, args.plot)


if __name__ == "__main__":
    main()
