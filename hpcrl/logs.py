"""Logging with a ``[role:rank]`` prefix on every line, to stderr and optionally to the worker's log file."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s [{role}:{rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(role: str, rank: int | str, level: str = "INFO", log_file: Path | None = None) -> None:
    """Configure the root logger of this process for one worker (or the controller)."""
    formatter = logging.Formatter(FORMAT.format(role=role, rank=rank), datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=handlers, force=True)
