"""The run directory ``<root>/<experiment>/<trial>/``: resolved config, worker logs, registry, checkpoints.

``config.yaml`` is the config the run started with; a resume that changed settings (``hpcrl.config.resume``) writes
the config it goes on with beside it, ``config.resumed-1.yaml``, ``config.resumed-2.yaml``, ..., each headed by the
changes. ``config_file`` is the newest of them: the config the run uses now, which every worker reads.

Each job of a ``-m`` sweep has its own, ``<root>/<experiment>/<trial>/<job number>/`` (Hydra's job number,
as in Hydra's own sweep directories), so no two jobs share metrics, checkpoints, registry or secret.
On a cluster it lies on a filesystem shared by every node: workers write their logs and register
their addresses there, and the controller reads them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def at(cls, root: str | Path, experiment: str, trial: str, job: int | None = None) -> RunDir:
        """Where the run directory is (nothing is made): ``job`` is the job's number in a ``-m`` sweep."""
        path = Path(root).expanduser().absolute() / experiment / trial
        return cls(path if job is None else path / str(job))

    @classmethod
    def create(cls, root: str | Path, experiment: str, trial: str, job: int | None = None) -> RunDir:
        run = cls.at(root, experiment, trial, job)
        for sub in (run.logs, run.registry, run.checkpoints):
            sub.mkdir(parents=True, exist_ok=True)
        return run

    def earlier_run(self) -> str:
        """What an earlier run left here, in words ("" if nothing): the last step it recorded, its checkpoints."""
        metrics = self.path / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        checkpoints = sorted(p.name for p in self.checkpoints.glob("step_*")) if self.checkpoints.is_dir() else []
        said = [f"metrics.jsonl up to line {len(lines)}"] if lines else []
        said += [f"checkpoints {', '.join(checkpoints)}"] if checkpoints else []
        return "; ".join(said)

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def registry(self) -> Path:
        return self.path / "registry"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def resumable(self) -> bool:
        """Whether a complete checkpoint is here (a step directory with its controller state: hpcrl/controller/
        recovery.py), which ``recover.mode=auto`` resumes from."""
        return self.newest_resumable_step() is not None

    def newest_resumable_step(self) -> int | None:
        """The step of the newest complete checkpoint here, the one ``recover.mode=auto`` tries first; None if none."""
        if not self.checkpoints.is_dir():
            return None
        steps = [p for p in self.checkpoints.iterdir() if _STEP_DIR.fullmatch(p.name)]
        complete = [int(p.name.removeprefix("step_")) for p in steps if (p / "controller.json").is_file()]
        return max(complete, default=None)

    @property
    def config_file(self) -> Path:
        """The config the run uses now: the newest ``config.resumed-N.yaml``, else ``config.yaml``."""
        resumed = self.resumed_configs()
        return resumed[-1] if resumed else self.first_config_file

    @property
    def first_config_file(self) -> Path:
        """The config the run started with, ``config.yaml``."""
        return self.path / "config.yaml"

    def resumed_configs(self) -> list[Path]:
        """The configs resumes with changed settings wrote, oldest first."""
        found = [(_resumed_number(p.name), p) for p in self.path.glob("config.resumed-*.yaml")]
        return [p for n, p in sorted(found) if n is not None]

    def log_file(self, role: str, rank: int) -> Path:
        return self.logs / f"{role}-{rank}.log"

    def write_config(self, text: str) -> Path:
        """Write the config the run uses now (``config_file``)."""
        path = self.config_file
        write_atomic(path, text)
        return path

    def write_first_config(self, text: str) -> Path:
        """Start the run's configs afresh: ``config.yaml``, and no resumed one (an earlier run's, which left no
        checkpoint to resume from, is deleted)."""
        for path in self.resumed_configs():
            path.unlink()
        write_atomic(self.first_config_file, text)
        return self.first_config_file

    def add_resumed_config(self, text: str) -> Path:
        """Write the config a resume goes on with as ``config.resumed-N.yaml``, N one past the newest; it is now
        ``config_file``."""
        resumed = self.resumed_configs()
        number = 1 + (_resumed_number(resumed[-1].name) or 0) if resumed else 1
        path = self.path / f"config.resumed-{number}.yaml"
        write_atomic(path, text)
        return path


_STEP_DIR = re.compile(r"step_\d+")  # a checkpoint's directory; .partial, .old and .broken ones are not
_RESUMED = re.compile(r"config\.resumed-(\d+)\.yaml")


def _resumed_number(name: str) -> int | None:
    found = _RESUMED.fullmatch(name)
    return int(found.group(1)) if found else None


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write a file so that readers see either the old content or the whole new one, never a part, and so that
    the new one survives a crash of the node once this returns (the file fsynced, renamed over, its directory
    fsynced)."""
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
    fsync_dir(path.parent)


def write_dir_atomic(out: Path, fill: Callable[[Path], None]) -> None:
    """``fill`` a fresh hidden sibling of ``out``, give its files the mode the umask gives any new file (safetensors
    writes its files 0600, which teammates on a shared cluster cannot read), then rename it to ``out`` (replacing
    one that is there), so a reader never sees half a directory."""
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    mode = 0o666 & ~current_umask()
    for path in tmp.rglob("*"):
        if path.is_file():
            os.chmod(path, mode)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def current_umask() -> int:
    """This process's umask, read without setting it (``os.umask`` sets it, for every thread at once)."""
    with open("/proc/self/status") as status:  # Linux >= 4.7
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise RuntimeError("/proc/self/status names no Umask")


def fsync_dir(path: Path) -> None:
    """fsync a directory, so the entries created or renamed in it survive a crash of the node."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
