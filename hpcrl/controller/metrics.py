"""What a run reports: ``metrics.jsonl`` (one line per step), TensorBoard events, a PNG plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTTED = (("reward_mean", "mean reward"), ("eval_accuracy", "held-out accuracy"), ("loss", "loss"))


class MetricsLog:
    """Appends one JSON line per step and mirrors each scalar to TensorBoard."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


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
