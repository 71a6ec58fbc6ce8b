"""What a run reports: ``metrics.jsonl`` (one line per step), a log line per step and per evaluation, TensorBoard
events and Weights & Biases (``metrics.loggers``), a PNG plot.

Weights & Biases runs in ``offline`` mode unless ``metrics.wandb.mode`` says otherwise (cluster nodes often have
no internet): it writes ``<run dir>/wandb/offline-run-*``, which ``wandb sync`` uploads later from any machine.
The W&B run id is made from the run directory, so a resumed run (``recover.mode=auto``) logs to the same run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from hpcrl.config.schema import MetricsConfig, WandbConfig
from hpcrl.rundir import fsync_dir, write_atomic

log = logging.getLogger(__name__)

PLOTTED = (("reward_mean", "mean reward"), ("eval_accuracy", "held-out accuracy"), ("loss", "loss"))


class MetricsLog:
    """Appends one JSON line per step, logs one line per step (and per evaluation), and mirrors each scalar to the
    loggers of ``metrics.loggers`` (TensorBoard, Weights & Biases).

    A step's ``samples`` (``sample_rows``: a few prompts with their completions and rewards, every
    ``metrics.samples_every_steps`` steps) go to ``samples.jsonl``, one line per prompt, and to the loggers as text
    (TensorBoard's text tab, a W&B table), never to ``metrics.jsonl``.

    A run that may follow an interrupted one (``recover.mode=auto``) passes ``keep_until``, the last step it
    does not train again (0 when it starts fresh): the lines of later steps are dropped from ``metrics.jsonl``
    and ``samples.jsonl``, and TensorBoard hides their events, so every step appears once.
    """

    def __init__(
        self,
        run_dir: Path,
        keep_until: int | None = None,
        settings: MetricsConfig | None = None,
        run_name: str = "",  # Weights & Biases' run name when metrics.wandb.name is empty
        run_config: Any = None,  # the run's config (a dataclass), shown by Weights & Biases
    ):
        settings = settings or MetricsConfig()
        self.path, self.samples_path = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
        purge_step = None
        if keep_until is not None:
            for path in (self.path, self.samples_path):
                if dropped := cut_metrics(path, keep_until):
                    log.info("dropped %d line(s) after step %d from %s: they run again", dropped, keep_until, path)
            purge_step = keep_until + 1
        self._file = self.path.open("a")
        self._samples = None  # samples.jsonl, opened when the first samples come
        self._entry_synced = False  # the file's directory entry: a resume's cut renamed over it, or open made it
        self._tb = None
        if "tensorboard" in settings.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)
        self._wandb = None
        if "wandb" in settings.loggers:
            self._wandb = start_wandb(run_dir, settings.wandb, run_name, run_config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append the step's line, handed to the OS (a killed process loses none); ``sync`` puts it on disk. Its
        ``samples``, if any, go to ``samples.jsonl`` and the loggers' text."""
        metrics = dict(metrics)
        if samples := metrics.pop("samples", None):
            self._log_samples(step, samples)
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        log.info("%s", step_line(step, metrics))
        if "eval_accuracy" in metrics:
            log.info("evaluation at step %d: held-out greedy accuracy %.3f", step, metrics["eval_accuracy"])
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def _log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if self._samples is None:
            self._samples = self.samples_path.open("a")
        self._samples.write("".join(json.dumps({"step": step, **row}) + "\n" for row in samples))
        self._samples.flush()
        if self._tb is not None:
            self._tb.add_text("samples", samples_markdown(samples), step)
        if self._wandb is not None:
            import wandb

            columns = ["prompt", "answer", "completion", "reward"]
            table = [[r["prompt"], r["answer"], c["text"], c["reward"]] for r in samples for c in r["completions"]]
            self._wandb.log({"samples": wandb.Table(columns=columns, data=table)}, step=step)

    def sync(self) -> None:
        """The lines so far on disk (fsync). The loop calls it before it marks a checkpoint complete, so a crash, of
        the node too, cannot leave a checkpoint that covers a step whose line is lost; lines after the newest
        checkpoint are not synced (an fsync a step cost the default job 0.4% of its time): a resume trains their
        steps again and logs them again. The first call fsyncs the run directory too, whose entry of the file is
        new (made by this run, or renamed over by a resume's ``cut_metrics``, which fsyncs it as well): without it
        a node's crash could bring back a complete checkpoint with no metrics file, or the old one."""
        os.fsync(self._file.fileno())
        if not self._entry_synced:
            fsync_dir(self.path.parent)
            self._entry_synced = True

    def close(self) -> None:
        self._file.close()
        if self._samples is not None:
            self._samples.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def sample_rows(groups: list[Any], count: int) -> list[dict[str, Any]]:
    """The first ``count`` groups of a batch as ``samples`` rows: the prompt, its answer, and each completion's text
    (what the reward read), reward (null when it failed) and finish reason."""
    return [
        {
            "prompt": g.prompt,
            "answer": g.answer,
            "completions": [{"text": s.text, "reward": s.reward, "finish_reason": s.finish_reason} for s in g.samples],
        }
        for g in groups[:count]
    ]


def samples_markdown(samples: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, one line per completion (TensorBoard renders its text as Markdown)."""
    lines = ["| prompt | answer | completion | reward |", "|---|---|---|---|"]
    for row in samples:
        for c in row["completions"]:
            cells = (row["prompt"], row["answer"], c["text"], c["reward"])
            lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def step_line(step: int, m: dict[str, Any]) -> str:
    """One step as a line of the controller's log: reward, accuracy when measured, step time, staleness, the
    rollout/trainer mismatch (mean and max |trainer - behaviour logprob|), rejections."""
    parts = [f"step {step}: reward {m.get('reward_mean', float('nan')):.3f}"]
    if "eval_accuracy" in m:
        parts.append(f"accuracy {m['eval_accuracy']:.3f}")
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4g}")
    parts.append(f"{m.get('time_step_s', float('nan')):.2f} s")
    parts.append(f"staleness {m.get('staleness_mean', 0.0):.2f} (max {m.get('staleness_max', 0)})")
    if "mismatch_abs_mean" in m:
        parts.append(f"mismatch {m['mismatch_abs_mean']:.3g} (max {m.get('mismatch_abs_max', float('nan')):.3g})")
    if "completion_len_mean" in m:
        parts.append(f"completion {m['completion_len_mean']:.1f} tokens")
    if m.get("groups_rejected"):
        parts.append(f"{m['groups_rejected']} groups rejected so far")
    return ", ".join(parts)


def wandb_run_id(run_dir: Path) -> str:
    """The same id for every start of the run in ``run_dir``, so a resumed run goes on in the same W&B run."""
    return hashlib.sha1(str(run_dir.absolute()).encode()).hexdigest()[:16]


def start_wandb(run_dir: Path, settings: WandbConfig, run_name: str, run_config: Any) -> Any:
    """A Weights & Biases run writing to ``<run dir>/wandb`` (offline: nothing leaves this machine until ``wandb
    sync``)."""
    import wandb

    config = dataclasses.asdict(run_config) if dataclasses.is_dataclass(run_config) else run_config
    run = wandb.init(
        mode=settings.mode,
        project=settings.project,
        entity=settings.entity or None,
        name=settings.name or run_name or run_dir.name,
        tags=list(settings.tags),
        config=config,
        dir=str(run_dir),
        id=wandb_run_id(run_dir),
        resume="allow" if settings.mode == "online" else None,
        settings=wandb.Settings(silent=True, console="off"),
    )
    where = run_dir / "wandb"
    if settings.mode == "offline":
        log.info("Weights & Biases (offline) writes to %s: upload it with `wandb sync %s/offline-run-*`", where, where)
    return run


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
