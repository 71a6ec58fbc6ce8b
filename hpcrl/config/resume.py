"""What a resumed run may change: the settings its checkpoints depend on stay as they were, the others apply.

A run resumed from a checkpoint (``recover.mode=auto``, or a requeued Slurm job) goes on with the trainers' weights
and optimizer state, the data position and the controller's counters. Its new config is compared with the one the
run uses (the run directory's ``config_file``), key by key:

- ``FIXED`` settings cannot change: the checkpoint holds or counts in what they made. Nor can the LoRA adapter's
  shape (``ADAPTER``: ``train.lora``'s rank, alpha and target modules, when either config trains an adapter), which
  the checkpoint's tensors have. A change is refused before anything starts (``ConfigError``, one line naming each
  with its old and new value), not left to the trainers' load, whose failure sets the checkpoint aside as broken.
- ``THIS_START`` settings say how this command starts (where the run is, whether it resumes, a dry run): never
  compared.
- Every other setting (the learning rate, ``run.max_steps``, logging, evaluation, checkpoint and export cadence,
  timeouts, the allocation and the cluster, ...) may change: the resume applies it (the trainers take the new
  learning rate and weight decay over the checkpoint's optimizer state: ``hpcrl.train.checkpoint``), and the run
  directory keeps the config the run started with and writes the one it goes on with beside it
  (``hpcrl.rundir``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config
from hpcrl.rundir import RunDir

FIXED = (
    "model.source",  # the weights a checkpoint holds grew from this model
    "model.path",
    "model.critic_path",
    "model.tiny",  # the checkpoint's tensors have the tiny model's shape
    "algorithm",  # the objective; the LR schedule counts its updates_per_batch; gae puts a critic in the checkpoint
    "dataset",  # the data position counts rows of this data, its prompts as templated
    "run.seed",  # ... in the order it shuffles them; the episodes' sampling seeds derive from it
    "workflow",  # what an episode is (the tiny model's alphabet holds the text it adds)
    "reward.fn",  # what the run rewards
)
# a LoRA checkpoint holds an adapter of this shape and no base weights, a full one no adapter (its dropout changes no
# weight): with full weights (rank 0 before and after) alpha and targets shape nothing
ADAPTER = ("train.lora.rank", "train.lora.alpha", "train.lora.target_modules")
THIS_START = ("run.root", "run.experiment", "run.trial", "run.dry_run", "recover.mode")


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


@dataclass(frozen=True)
class Resume:
    """A start that resumes from a checkpoint: the config the run used until now, and what this start changes."""

    saved: Config
    changes: list[Change]

    def header(self, was: Path) -> str:
        """The comment that heads the config this resume goes on with: what changed, and from which file."""
        lines = [f"resumed with these changes from {was.name}:", *map(str, self.changes)]
        return "".join(f"# {line}\n" for line in lines)


def check_start(cfg: Config, run_dir: RunDir) -> Resume | None:
    """How ``cfg`` starts in ``run_dir``: None for a new run (step 1), else the ``Resume`` from its checkpoints.

    ConfigError when an earlier run left steps there and ``recover.mode=off`` (starting afresh would mix two runs'
    metrics and prune the new run's checkpoints), when ``run.max_steps`` is below the newest checkpoint's step, or
    when a resume changes a ``FIXED`` setting."""
    if cfg.recover.mode == "off":
        earlier = run_dir.earlier_run()
        if earlier:
            raise ConfigError(
                "recover.mode",
                "off",
                f"auto to resume the run in {run_dir.path} ({earlier}), or a new run.trial to start another one",
            )
        return None
    step = run_dir.newest_resumable_step()
    if step is None:  # nothing to resume from: the run starts at step 1, with any settings
        return None
    if 0 < cfg.run.max_steps < step:  # at step itself the run is complete: a requeued job only exports again
        raise ConfigError(
            "run.max_steps",
            cfg.run.max_steps,
            f"at least {step}, the step of the newest checkpoint in {run_dir.checkpoints} that recover.mode=auto "
            f"resumes from: below it nothing is left to train (to evaluate that checkpoint: run.max_steps=0 "
            f"model.path=<the checkpoint> in another run.trial)",
        )
    from hpcrl.config.load import load_run_config

    saved = load_run_config(run_dir.config_file)
    return Resume(saved, check_changes(saved, cfg, run_dir))


def check_changes(saved: Config, new: Config, run_dir: RunDir) -> list[Change]:
    """The settings ``new`` changes from ``saved``, the config of the run in ``run_dir``; ConfigError naming every
    ``FIXED`` one changed, and every ``ADAPTER`` one when either trains a LoRA adapter, with the first as the field."""
    changes = changed_settings(saved, new)
    adapter = saved.train.lora.rank > 0 or new.train.lora.rank > 0
    fixed = [c for c in changes if _under(c.key, FIXED) or (adapter and c.key in ADAPTER)]
    if fixed:
        first = fixed[0]
        raise ConfigError(
            first.key,
            first.new,
            f"{first.old!r}, as the run in {run_dir.path} ({run_dir.config_file.name}) has it: a resume keeps the "
            f"model, algorithm, dataset, run.seed, workflow, reward.fn and LoRA adapter shape its checkpoints were "
            f"made with (changed: {'; '.join(map(str, fixed))}); set them back, or start a new run with another "
            "run.trial",
        )
    return changes


def changed_settings(saved: Config, new: Config) -> list[Change]:
    """Every setting (a leaf key; a list is one value) whose value differs, in the schema's order; ``THIS_START``
    keys left out, ``model.path`` compared as the run resolves it."""
    old_flat, new_flat = flatten(_comparable(saved)), flatten(_comparable(new))
    keys = list(old_flat) + [k for k in new_flat if k not in old_flat]
    missing = "<unset>"  # a key of a dict setting (cluster.env, cluster.roles) on one side only
    return [
        Change(k, old_flat.get(k, missing), new_flat.get(k, missing))
        for k in keys
        if not _under(k, THIS_START) and old_flat.get(k, missing) != new_flat.get(k, missing)
    ]


def applied(resume: Resume, cfg: Config) -> Config:
    """``cfg`` with the model path the run resolved at its start (the tiny model it made, an absolute path), which
    every worker reads."""
    return replace(cfg, model=replace(cfg.model, path=resume.saved.model.path))


def _comparable(cfg: Config) -> Config:
    """``model.path`` as the job resolves it (``controller.job.prepare_model``): absolute, or, for a tiny model,
    the one it made in the run directory (no setting)."""
    path = str(Path(cfg.model.path).expanduser().absolute()) if cfg.model.source == "local" else ""
    return replace(cfg, model=replace(cfg.model, path=path))


def flatten(cfg: Config) -> dict[str, Any]:
    """Every leaf setting by its dotted key: ``{"train.lr": 0.0005, "cluster.roles.server.mem_gb": 0.0, ...}``."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):  # an empty one holds no setting: {} -> {A: 1} is one change, of key A
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            out[prefix] = node

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg)))
    return out


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)
