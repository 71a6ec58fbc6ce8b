"""Checkpoints of a whole run, and resuming from the newest complete one (``recover.mode=auto``).

    <run dir>/checkpoints/
        step_000004/            the trainers' sharded state (hpcrl/train/checkpoint.py: written as
                                step_000004.partial and renamed once every rank is done)
            controller.json     the controller's state, written last: a step directory without it is incomplete
        latest                  "step_000004": the newest complete checkpoint, for people and tools

Saving (the loop, between steps, every ``checkpoint.every_steps`` steps): the controller's state is taken (step,
weight version, data position, RNG states, counters, eval accuracy) -> the trainers write ``step_NNNNNN`` ->
``controller.json`` is written into it -> ``latest`` is rewritten -> complete checkpoints older than the newest
``checkpoint.keep`` are deleted. Both files are written atomically (a temporary file renamed over the name), so a
crash at any moment leaves every earlier checkpoint whole (a prune starts once the new one is complete) and, at
worst, a ``.partial`` directory or a step directory without ``controller.json``.

Resuming (``recover.mode=auto``, the same run directory): the checkpoint is the newest step directory that has
``controller.json`` (not ``latest``, which a crash between the two writes leaves one behind); incomplete ones are
deleted. The loop then has the trainers load it, gives the servers its weights tagged with its weight version
before any rollout (so every token's version, and staleness, go on from there), restores the controller's
state, cuts ``metrics.jsonl`` back to its step and goes on at the next step.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcrl.rundir import write_atomic

log = logging.getLogger(__name__)

CONTROLLER_FILE = "controller.json"
LATEST_FILE = "latest"
_CHECKPOINT_NAME = re.compile(r"step_(\d+)")  # step_000004; step_000004.partial and .old are the trainers' temporaries


@dataclass
class ControllerState:
    """What the controller needs to go on, besides the trainers' state."""

    step: int  # the last step trained
    weight_version: int  # the version of the weights after that step, which the servers must hold
    rows: dict[str, Any]  # the data position (TrainingRows.state)
    counters: dict[str, int]  # Loop.counters: reward errors, dropped groups, equal-reward groups
    groups_rejected: int  # groups the rollout executor rejected so far
    eval_accuracy_before: float  # held-out accuracy before step 1
    eval_accuracy_last: float  # the latest held-out accuracy measured
    rng: dict[str, Any]  # the controller's global generators: Python's, NumPy's and torch's (rng_states)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ControllerState:
        return cls(**json.loads(text))


class Checkpoints:
    """The run's ``checkpoints/`` directory: where step N goes, marking one complete, finding the newest."""

    def __init__(self, directory: Path, keep: int = 0):
        self.directory = directory
        self.keep = keep  # complete checkpoints kept, the newest; 0 = every one

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step_{step:06d}"

    def publish(self, state: ControllerState) -> Path:
        """Mark the checkpoint of ``state.step`` complete (the trainers' part is written); point ``latest`` at it."""
        path = self.step_dir(state.step)
        write_atomic(path / CONTROLLER_FILE, state.to_json())
        write_atomic(self.directory / LATEST_FILE, path.name + "\n")
        self.prune()
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

    def latest(self) -> tuple[Path, ControllerState] | None:
        complete = self.complete()
        if not complete:
            return None
        path = complete[-1]
        try:
            return path, ControllerState.from_json((path / CONTROLLER_FILE).read_text())
        except (ValueError, TypeError) as e:  # written atomically, so only another hpcrl version's file
            raise ValueError(
                f"{path / CONTROLLER_FILE} is not a controller state this hpcrl can read ({e}): resume with the "
                "hpcrl version that wrote it, or start a new run.trial"
            ) from e

    def remove_incomplete(self) -> list[str]:
        """Delete what interrupted saves left (``.partial``, ``.old``, step directories without their marker)."""
        complete = set(self.complete())
        removed = []
        for entry in self._step_entries(temporaries=True):
            if entry in complete:
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


def find_checkpoint(mode: str, checkpoints: Checkpoints) -> tuple[Path, ControllerState] | None:
    """The checkpoint to resume from under ``recover.mode``; None: start at step 1."""
    if mode == "off":
        if checkpoints.complete():
            log.warning("recover.mode=off: starting at step 1, not from the checkpoints in %s", checkpoints.directory)
        return None
    for name in checkpoints.remove_incomplete():
        log.warning("deleted %s in %s: an interrupted checkpoint", name, checkpoints.directory)
    found = checkpoints.latest()
    if found is None:
        log.info("recover.mode=auto: no complete checkpoint in %s; starting at step 1", checkpoints.directory)
    else:
        log.info("recover.mode=auto: resuming from %s (step %d)", found[0], found[1].step)
    return found


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
