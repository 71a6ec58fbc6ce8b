"""Prompts and reference answers, as Hugging Face ``datasets`` of ``{"prompt": str, "answer": str}`` rows.

``load_splits`` picks the source named by ``dataset.name``: ``mod10`` (synthetic, ``mod10.py``) or
``files`` (local jsonl/json/parquet, ``files.py``), and says in one line how many rows train and how many are
held out, and where each come from (``split_line``).

The held-out rows of ``files``: ``dataset.eval_files``, or without them ``dataset.holdout`` rows of the training
files, drawn with the run's seed and removed from training. A split that leaves fewer training rows than one
batch (``rollout.prompts_per_step``) is refused (``holdout_problem``), before the run starts too
(``hpcrl.config.preflight``), with the same line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from datasets import Dataset

from hpcrl.config.schema import DatasetConfig
from hpcrl.data.files import DataError, check_columns, decode_columns, load_rows
from hpcrl.data.mod10 import FEATURES, make_mod10

if TYPE_CHECKING:
    from hpcrl.reward.registry import RewardFns

__all__ = ["FEATURES", "DataError", "decode_columns", "load_rows", "load_splits", "make_mod10"]

log = logging.getLogger(__name__)

MOD10 = "dataset.name=mod10"  # where its rows come from, in messages


def load_splits(
    cfg: DatasetConfig,
    seed: int,
    cache_dir: str | None = None,
    *,
    batch: int = 1,  # rows one train step takes (rollout.prompts_per_step): a held-out split must leave as many
    rewards: RewardFns | None = None,  # the reward functions: the columns they take go with each row
) -> tuple[Dataset, Dataset]:
    """The training and held-out rows the config names (module docstring); ``cache_dir`` is where ``datasets`` keeps
    its Arrow cache (None = its default). ``train_size`` and ``eval_size`` apply to ``mod10`` only, ``holdout`` to
    ``files`` without ``eval_files``."""
    needs = rewards.needs() if rewards is not None else {}
    if cfg.name == "mod10":
        if cfg.train_files or cfg.eval_files:
            log.warning("dataset.name=mod10 makes its rows: dataset.train_files and dataset.eval_files are ignored")
        check_columns(MOD10, list(FEATURES), needs, "its rows hold")
        train, held_out = make_mod10(cfg.train_size, cfg.eval_size, seed)
        log.info("%s", split_line(cfg, len(train), len(held_out)))
        return train, held_out
    if cfg.name != "files":
        raise DataError(f"dataset.name={cfg.name!r} is invalid: expected mod10 or files")
    if not cfg.train_files:
        raise DataError("dataset.train_files is empty: dataset.name=files needs at least one local file")
    columns = (cfg.prompt_column, cfg.answer_column, cfg.prompt_template)
    takes = rewards.columns() if rewards is not None else ()
    train = load_rows(cfg.train_files, *columns, cache_dir=cache_dir, takes=takes, needs=needs)
    if cfg.eval_files:
        held_out = load_rows(cfg.eval_files, *columns, cache_dir=cache_dir, takes=takes, needs=needs)
        log.info("%s", split_line(cfg, len(train), len(held_out)))
        return train, held_out
    problem = holdout_problem(len(train), cfg.holdout, batch)
    if problem:
        raise DataError(f"dataset.holdout={cfg.holdout} is invalid: expected {problem}")
    split = train.train_test_split(test_size=cfg.holdout, shuffle=True, seed=seed)
    log.info("%s", split_line(cfg, len(split["train"]), len(split["test"])))
    return split["train"], split["test"]


def holdout_problem(rows: int, holdout: int, batch: int) -> str:
    """Why holding ``holdout`` of ``rows`` training rows out cannot be (``dataset.holdout``'s expected value), or "":
    it must leave a batch (``batch`` rows) to train on."""
    left = rows - holdout
    if left >= max(batch, 1):
        return ""
    leaves = f"leaves {left} to train on" if left > 0 else "leaves none to train on"
    short = f", fewer than one batch (rollout.prompts_per_step={batch})" if left > 0 else ""
    return (
        f"fewer rows held out: dataset.train_files hold {rows} rows, and holding out {holdout} {leaves}{short}; "
        "lower dataset.holdout, or set dataset.eval_files (held-out rows of their own)"
    )


def split_line(cfg: DatasetConfig, train: int, held_out: int) -> str:
    """The one line that says how many rows train and how many are held out, and where each come from."""
    if cfg.name == "mod10":
        return (
            f"dataset: {_rows(train)} to train on and {held_out} held out for evaluation, made by mod10 "
            "(dataset.train_size, dataset.eval_size)"
        )
    if cfg.eval_files:
        return (
            f"dataset: {_rows(train)} of dataset.train_files to train on, {_rows(held_out)} of dataset.eval_files "
            "held out for evaluation"
        )
    return (
        f"dataset: {_rows(train + held_out)} in dataset.train_files: {train} to train on, {held_out} held out for "
        f"evaluation (dataset.holdout={held_out}, drawn with run.seed; dataset.eval_files sets held-out rows of their "
        "own)"
    )


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"
