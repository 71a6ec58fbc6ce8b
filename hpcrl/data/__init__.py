"""Prompts and reference answers, as Hugging Face ``datasets`` of ``{"prompt": str, "answer": str}`` rows.

``load_splits`` picks the source named by ``dataset.name``: ``mod10`` (synthetic, ``mod10.py``) or
``files`` (local jsonl/json/parquet, ``files.py``).
"""

from __future__ import annotations

import logging

from datasets import Dataset

from hpcrl.config.schema import DatasetConfig
from hpcrl.data.files import DataError, load_rows
from hpcrl.data.mod10 import FEATURES, make_mod10

__all__ = ["FEATURES", "DataError", "load_rows", "load_splits", "make_mod10"]

log = logging.getLogger(__name__)


def load_splits(cfg: DatasetConfig, seed: int, cache_dir: str | None = None) -> tuple[Dataset, Dataset]:
    """The training and held-out rows the config names.

    ``files``: ``train_files`` and ``eval_files``; without ``eval_files``, ``eval_size`` rows of the
    training files, picked with ``seed``, are held out (and removed from training). ``train_size``
    applies to ``mod10`` only. ``cache_dir`` is where ``datasets`` keeps its Arrow cache (None = its default).
    """
    if cfg.name == "mod10":
        if cfg.train_files or cfg.eval_files:
            log.warning("dataset.name=mod10 makes its rows: dataset.train_files and dataset.eval_files are ignored")
        return make_mod10(cfg.train_size, cfg.eval_size, seed)
    if cfg.name != "files":
        raise DataError(f"dataset.name={cfg.name!r} is invalid: expected mod10 or files")
    if not cfg.train_files:
        raise DataError("dataset.train_files is empty: dataset.name=files needs at least one local file")
    columns = (cfg.prompt_column, cfg.answer_column, cfg.prompt_template)
    train = load_rows(cfg.train_files, *columns, cache_dir=cache_dir)
    if cfg.eval_files:
        return train, load_rows(cfg.eval_files, *columns, cache_dir=cache_dir)
    if cfg.eval_size <= 0:
        return train, Dataset.from_dict({"prompt": [], "answer": []}, features=FEATURES)
    if cfg.eval_size >= len(train):
        raise DataError(
            f"dataset.eval_size={cfg.eval_size} is invalid: the training files hold {len(train)} rows, and "
            "holding out that many leaves none to train on; lower eval_size or set dataset.eval_files"
        )
    split = train.train_test_split(test_size=cfg.eval_size, shuffle=True, seed=seed)
    log.info("held out %d of %d rows of dataset.train_files for evaluation", cfg.eval_size, len(train))
    return split["train"], split["test"]
