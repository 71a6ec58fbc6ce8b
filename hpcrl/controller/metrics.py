"""What a run reports: ``metrics.jsonl`` (one line per step), TensorBoard events, a PNG plot."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from hpcrl.rundir import write_atomic

log = logging.getLogger(__name__)

PLOTTED = (("reward_mean", "mean reward"), ("eval_accuracy", "held-out accuracy"), ("loss", "loss"))


class MetricsLog:
    """Appends one JSON line per step and mirrors each scalar to TensorBoard.

    A run that may follow an interrupted one (``recover.mode=auto``) passes ``keep_until``, the last step it
    does not train again (0 when it starts fresh): the lines of later steps are dropped from ``metrics.jsonl``,
    and TensorBoard hides their events, so every step appears once.
    """

    def __init__(self, run_dir: Path, keep_until: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        purge_step = None
        if keep_until is not None:
            if dropped := cut_metrics(self.path, keep_until):
                log.info("dropped %d line(s) after step %d from %s: they run again", dropped, keep_until, self.path)
            purge_step = keep_until + 1
        self._file = self.path.open("a")
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append the step's line and put it on disk before returning: the loop marks a checkpoint of this step
        complete only after this, so a crash cannot leave a checkpoint that covers a step whose line is lost."""
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def cut_metrics(path: Path, last_step: int) -> int:
    """Keep the lines of steps up to ``last_step`` (a resumed run writes the later ones again); return how many
    lines were dropped, a line cut short by a crash included."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    steps = [_step_of(line) for line in lines]
    kept = [line for line, step in zip(lines, steps, strict=True) if step is not None and step <= last_step]
    write_atomic(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):  # a line cut short (json's errors are ValueErrors), or not a step's
        return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(metrics_file: Path, out_png: Path) -> Path:
    """Reward, held-out accuracy and loss against the step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    fig, axes = plt.subplots(len(PLOTTED), 1, figsize=(7, 2.4 * len(PLOTTED)), sharex=True)
    for ax, (key, label) in zip(axes, PLOTTED, strict=True):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points, strict=True), marker="." if key == "eval_accuracy" else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
