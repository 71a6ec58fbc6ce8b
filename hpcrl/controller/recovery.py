"""Checkpoints of a whole run, and resuming from the newest usable one (``recover.mode=auto``).

    <run dir>/checkpoints/
        step_000004/            the trainers' sharded state (hpcrl/train/checkpoint.py: written as
                                step_000004.partial and renamed once every rank is done)
            controller.json     the controller's state, written last: a step directory without it is incomplete
        step_000006.broken/     a checkpoint a resume found unusable, set aside (never deleted by hpcrl)
        latest                  "step_000004": the newest complete checkpoint, for people and tools

Saving (the loop, between steps, every ``checkpoint.every_steps`` steps): the controller's state is taken (step,
weight version, data position, RNG states, counters, eval accuracy) -> the trainers write ``step_NNNNNN``, every
file fsynced, then the directory, renamed into place and the parent fsynced -> the step's metrics line is
written and fsynced (the first time, the run directory too: its entry of ``metrics.jsonl``) -> ``controller.json``
is written into the step directory (fsynced, renamed over, the directory fsynced): now the checkpoint is complete
-> complete checkpoints older than the newest ``checkpoint.keep`` are deleted -> ``latest`` is replaced (a
temporary file renamed over it, fsynced, the directory fsynced). So a
crash of the node at any moment leaves every earlier checkpoint whole (a prune starts once the new one is
complete and on disk) and, at worst, a ``.partial`` directory or a step directory without ``controller.json``.

Resuming (``recover.mode=auto``, the same run directory): incomplete saves are deleted; then, newest first, a
complete checkpoint is taken if its ``controller.json`` reads and every part of the trainers' state is there and
whole (``check_checkpoint``: the trainer state file, the tensors' metadata, every tensor file as long as the
metadata says); one that is not, or that the trainers then fail to load, is renamed ``.broken`` with a warning
naming what was wrong, and the one before is tried. ``latest`` is not read (a crash between the two writes
leaves it one behind). The loop then has the trainers load it, gives the servers its weights tagged with its
weight version before any rollout (so every token's version, and staleness, go on from there), restores the
controller's state, cuts ``metrics.jsonl`` back to its step and goes on at the next step.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.rundir import fsync_dir, write_atomic
from hpcrl.train.checkpoint import check_checkpoint

log = logging.getLogger(__name__)

CONTROLLER_FILE = "controller.json"
LATEST_FILE = "latest"
BROKEN_SUFFIX = ".broken"
_CHECKPOINT_NAME = re.compile(r"step_(\d+)")  # step_000004; step_000004.partial and .old are the trainers' temporaries


@dataclass
class ControllerState:
    """What the controller needs to go on, besides the trainers' state."""

    step: int  # the last step trained
    weight_version: int  # the version of the weights after that step, which the servers must hold
    rows: dict[str, Any]  # the data position (TrainingRows.state)
    counters: dict[str, int]  # Loop.counters: reward errors, dropped groups, equal-reward groups
    groups_rejected: int  # groups the rollout executor rejected so far, all causes
    eval_accuracy_before: float  # held-out accuracy before step 1
    eval_accuracy_last: float  # the latest held-out accuracy measured
    rng: dict[str, Any]  # the controller's global generators: Python's, NumPy's and torch's (rng_states)
    rejected_by_cause: dict[str, int] = field(default_factory=dict)  # the same, by cause (RolloutExecutor.rejected)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ControllerState:
        return cls(**json.loads(text))


class Checkpoints:
    """The run's ``checkpoints/`` directory: where step N goes, marking one complete, finding the newest."""

    def __init__(self, directory: Path, keep: int = 0, check_trainers: Callable[[Path], str | None] | None = None):
        self.directory = directory
        self.keep = keep  # complete checkpoints kept, the newest; 0 = every one
        # what is wrong with a checkpoint's trainer part, or None (hpcrl/train/checkpoint.py's check_checkpoint)
        self.check_trainers = check_trainers or check_checkpoint

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step_{step:06d}"

    def publish(self, state: ControllerState) -> Path:
        """Mark the checkpoint of ``state.step`` complete (the trainers' part is written); point ``latest`` at it."""
        path = self.step_dir(state.step)
        # fsynced, renamed into place, the directory fsynced: from here on the checkpoint is complete, even after a
        # crash of the node
        write_atomic(path / CONTROLLER_FILE, state.to_json())
        self.prune()
        write_atomic(self.directory / LATEST_FILE, path.name + "\n")
        return path

    def prune(self) -> list[str]:
        """Delete the complete checkpoints older than the newest ``keep`` (none when keep is 0), oldest first."""
        old = self.complete()[: -self.keep] if self.keep else []
        for path in old:
            shutil.rmtree(path)
            log.info("deleted checkpoint %s: checkpoint.keep=%d newer ones are kept", path.name, self.keep)
        return [p.name for p in old]

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        found = [p for p in self._step_entries() if p.is_dir() and (p / CONTROLLER_FILE).is_file()]
        return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))

    def usable(self) -> Iterator[tuple[Path, ControllerState]]:
        """Complete checkpoints, newest first, whose every part is there and whole; an older one is only looked
        at once the caller asks for the next (the newer could not be loaded). Unusable ones are set aside."""
        for path in reversed(self.complete()):
            try:
                state = ControllerState.from_json((path / CONTROLLER_FILE).read_text())
            except (ValueError, TypeError) as e:  # written atomically: another hpcrl version's file, or a bad disk
                self.set_aside(path, f"{CONTROLLER_FILE} is not a controller state this hpcrl can read ({e})")
                continue
            problem = self.check_trainers(path)
            if problem is not None:
                self.set_aside(path, problem)
                continue
            yield path, state

    def set_aside(self, path: Path, why: str) -> Path:
        """Rename an unusable checkpoint ``<name>.broken`` (kept for a look, out of every count) and say why."""
        aside = path.with_name(path.name + BROKEN_SUFFIX)
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        fsync_dir(self.directory)
        log.warning("checkpoint %s cannot be resumed from: %s; it is kept as %s, trying the one before", path.name,
                    why, aside.name)  # fmt: skip
        return aside

    def remove_incomplete(self) -> list[str]:
        """Delete what interrupted saves left (``.partial``, ``.old``, step directories without their marker)."""
        complete = set(self.complete())
        removed = []
        for entry in self._step_entries(temporaries=True):
            if entry in complete or entry.name.endswith(BROKEN_SUFFIX):
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
        return removed

    def _step_entries(self, temporaries: bool = False) -> list[Path]:
        if not self.directory.is_dir():
            return []
        match = _CHECKPOINT_NAME.match if temporaries else _CHECKPOINT_NAME.fullmatch
        return [p for p in self.directory.iterdir() if match(p.name)]


def resume_candidates(mode: str, checkpoints: Checkpoints) -> Iterator[tuple[Path, ControllerState]]:
    """The checkpoints to resume from under ``recover.mode``, newest usable first; none: start at step 1."""
    if mode == "off":
        if checkpoints.complete():
            log.warning("recover.mode=off: starting at step 1, not from the checkpoints in %s", checkpoints.directory)
        return iter(())
    for name in checkpoints.remove_incomplete():
        log.warning("deleted %s in %s: an interrupted checkpoint", name, checkpoints.directory)
    return checkpoints.usable()


def rng_states() -> dict[str, Any]:
    """The controller's global random generators (Python's, NumPy's, torch's CPU one), as JSON values."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    torch_state = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np.asarray(keys).tolist(), pos, has_gauss, cached],
        "torch": torch_state,
    }


def set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np
    import torch

    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(states["torch"])), dtype=torch.uint8))
