"""Logging with a ``[role:rank]`` prefix on every line, to stderr and optionally to the worker's log file."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

FORMAT = "%(asctime)s [{role}:{rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(role: str, rank: int | str, level: str = "INFO", log_file: Path | None = None) -> None:
    """Configure the root logger of this process for one worker (or the controller); library progress bars only
    where stderr is a terminal (``library_bars_off_unless_terminal``)."""
    library_bars_off_unless_terminal()
    formatter = logging.Formatter(FORMAT.format(role=role, rank=rank), datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=handlers, force=True)


def library_bars_off_unless_terminal() -> None:
    """No progress bars from Hugging Face libraries (transformers' "Loading weights", "Writing model shards") unless
    stderr is a terminal: in a log file or a Slurm job's output each is a line of carriage-return frames. Through
    ``HF_HUB_DISABLE_PROGRESS_BARS``, which the processes this one starts inherit, and, where huggingface_hub or
    transformers is imported already (they read it on import), their own switches; a value the user set wins."""
    if sys.stderr.isatty() or os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") != "1":
        return
    if "huggingface_hub" in sys.modules:  # e.g. through datasets, as the config's checks read data files
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
