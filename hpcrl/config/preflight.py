"""What a config names outside itself, checked where a run is launched, before anything starts or is submitted.

    model.path          a directory with config.json, tokenizer files and weights (model.source=local)
    dataset files       dataset.train_files and dataset.eval_files exist, as .jsonl, .json or .parquet files
    metrics.loggers     wandb is installed when it is named
    workflow            a plug-in's .jinja chat template exists
    tiny-task settings  a warning naming each of the default job's settings left in force with a local model

``checks.validate`` is not the place: every worker validates the run's config.yaml on its own node, where
the controller's relative paths may not resolve and the data files are never read. ``hpcrl.main`` (the dry
run too, and the submitting process of ``-m``), ``hpcrl.sbatch`` and ``hpcrl.doctor`` call ``preflight``.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")  # any one
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

# The default job's settings, made for its tiny model and one-digit task, that a real model left with them
# trains badly: (key, the tiny task's value, why). tests/config/test_presets.py holds them equal to the default.
TINY_TASK_SETTINGS: tuple[tuple[str, object, str], ...] = (
    ("train.lr", 5e-4, "a 0.5B-7B model wants about 1e-6"),
    ("train.warmup_steps", 0, "a real model wants a few steps of warm-up"),
    ("rollout.max_new_tokens", 2, "one digit; a worked answer takes hundreds of tokens"),
    ("eval.stop_at_accuracy", 0.9, "the run stops at 0.9 held-out accuracy"),
    ("dataset.name", "mod10", "the synthetic a+b task"),
)


def preflight(cfg: Config) -> None:
    """Raise ConfigError for a missing model directory, dataset file or logger package (``warn_tiny_task_settings``
    is separate: it is called once logging is set up)."""
    if cfg.model.source == "local":
        check_model_dir(cfg.model.path)
    for key in ("train_files", "eval_files"):
        check_data_files(f"dataset.{key}", getattr(cfg.dataset, key))
    template = cfg.workflow.chat_template
    if template.endswith(".jinja") and not Path(template).expanduser().is_file():
        raise ConfigError("workflow.chat_template", template, f"a .jinja file: {Path(template).absolute()} is not one")
    if "wandb" in cfg.metrics.loggers and importlib.util.find_spec("wandb") is None:
        expected = "a list without wandb, or wandb installed: pip install 'hpcrl[wandb]'"
        raise ConfigError("metrics.loggers", cfg.metrics.loggers, expected)


def check_model_dir(path: str) -> None:
    """A Hugging Face model directory: config.json, a tokenizer, weights. ConfigError naming what is missing."""
    where = Path(path).expanduser()
    expected = "a Hugging Face model directory (config.json, tokenizer files, *.safetensors)"
    if not where.is_dir():
        why = "is not a directory" if where.exists() else "does not exist"
        raise ConfigError("model.path", path, f"{expected}: {where.absolute()} {why}{_hub_hint(path, where)}")
    missing = []
    if not (where / CONFIG_FILE).is_file():
        missing.append(CONFIG_FILE)
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if not any(next(where.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if missing:
        raise ConfigError("model.path", path, f"{expected}: {where.absolute()} has no {', no '.join(missing)}")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # what a Hugging Face Hub repository id looks like


def _hub_hint(path: str, where: Path) -> str:
    """For a ``model.path`` that is no directory here but reads as a Hub id: hpcrl loads only local directories."""
    if where.exists() or not HUB_ID.fullmatch(path):
        return ""
    return (
        f"; {path!r} looks like a Hugging Face Hub id, and hpcrl downloads nothing (cluster nodes often have no "
        f"internet): on a machine that has it, `hf download {path} --local-dir DIR`, then model.path=DIR on a "
        "filesystem the nodes share"
    )


def check_data_files(key: str, files: list[str]) -> None:
    for file in files:
        path = Path(file).expanduser()
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise ConfigError(key, files, f"local {', '.join(DATA_SUFFIXES)} files: {file} has another extension")
        if not path.is_file():
            why = "is not a file" if path.exists() else "does not exist"
            raise ConfigError(key, files, f"local data files: {file} {why} (resolved to {path.absolute()})")


def tiny_task_settings_in_force(cfg: Config) -> list[str]:
    """``key=value (why)`` for each of the default job's settings ``cfg`` keeps."""
    kept = []
    for key, value, why in TINY_TASK_SETTINGS:
        node: object = cfg
        for part in key.split("."):
            node = getattr(node, part)
        if node == value:
            kept.append(f"{key}={value} ({why})")
    return kept


def warn_tiny_task_settings(cfg: Config) -> None:
    if cfg.model.source != "local":
        return
    kept = tiny_task_settings_in_force(cfg)
    if kept:
        log.warning(
            "model.source=local keeps the tiny task's %s: set them, or start from a preset for real models such "
            "as experiment=gsm8k (docs/quickstart.md shows both side by side)",
            "; ".join(kept),
        )
