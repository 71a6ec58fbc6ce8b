"""The run directory ``<root>/<experiment>/<trial>/``: resolved config, worker logs, registry, checkpoints.

On a cluster it lies on a filesystem shared by every node: workers write their logs and register
their addresses there, and the controller reads them.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, root: str | Path, experiment: str, trial: str) -> RunDir:
        run = cls(Path(root).expanduser().absolute() / experiment / trial)
        for sub in (run.logs, run.registry, run.checkpoints):
            sub.mkdir(parents=True, exist_ok=True)
        return run

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def registry(self) -> Path:
        return self.path / "registry"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    def log_file(self, role: str, rank: int) -> Path:
        return self.logs / f"{role}-{rank}.log"

    def write_config(self, text: str) -> Path:
        write_atomic(self.config_file, text)
        return self.config_file


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write a file so that readers see either the old content or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
