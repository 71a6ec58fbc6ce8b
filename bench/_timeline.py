"""``python bench/_timeline.py OUT.json OVERRIDE ...``: ``python -m hpcrl.main`` with a wall-clock timeline.

The controller's process records, on one monotonic clock, when each of these was under way, and writes the
intervals to OUT.json when the job ends: ``step`` (one ``Loop._step``: rollout wait, train, weight sync),
``gen`` (one generate request in flight to a server), ``train`` (one train-step RPC to the trainers), ``sync``
(one weight push, servers paused), ``reward`` (one reward-pool call), ``judge`` (one batched request to the reward
model's servers, inside a reward call), ``eval``; and the parts of a push:
``export`` (the trainers' export RPC, or the export at a train call's end: below), ``load``
(``/update_weights_from_disk`` on every server), ``pause`` (a pause or continue call, when a push makes them).
When the step's last train call writes the servers' weights itself (the disk sync since the export went into
the train step), the end of that call, as long as the trainer's ``time_weights_export_s``, is ``export`` and
``sync``, not ``train``. The wrappers are installed on the classes before the job builds anything; they only
take the time, so the job runs its own code paths. A method a version of hpcrl lacks is skipped, so the same
file times an older checkout too.
"""

from __future__ import annotations

import functools
import json
import runpy
import sys
import time
from typing import Any

INTERVALS: list[tuple[str, float, float, Any]] = []  # (kind, start, end, step or None)


def timed(cls: type, method: str, kind: str, step_arg: bool = False) -> None:
    original = getattr(cls, method, None)
    if original is None:
        return

    @functools.wraps(original)
    async def wrapper(self, *args, **kwargs):
        start = time.monotonic()
        try:
            return await original(self, *args, **kwargs)
        finally:
            INTERVALS.append((kind, start, time.monotonic(), args[0] if step_arg else None))

    setattr(cls, method, wrapper)


def timed_train_step(cls: type) -> None:
    """``train``, less the export at its end when the call wrote the servers' weights (``export`` and ``sync``)."""
    original = cls.train_step

    @functools.wraps(original)
    async def wrapper(self, *args, **kwargs):
        start = time.monotonic()
        metrics = {}
        try:
            metrics = await original(self, *args, **kwargs)
            return metrics
        finally:
            end = time.monotonic()
            export_end = end
            end -= min(end - start, metrics.get("time_weights_export_s", 0.0))
            INTERVALS.append(("train", start, end, None))
            if export_end > end:
                INTERVALS.append(("export", end, export_end, None))
                INTERVALS.append(("sync", end, export_end, None))

    cls.train_step = wrapper


def install() -> None:
    from hpcrl.controller.loop import Loop
    from hpcrl.controller.trainers import Trainers
    from hpcrl.controller.weights import WeightSync
    from hpcrl.inference.client import InferenceClient
    from hpcrl.reward.pool import RewardPool

    try:
        from hpcrl.reward.model_client import RewardModelClient
    except ImportError:  # an older checkout: no reward model
        RewardModelClient = None

    timed(Loop, "_step", "step", step_arg=True)
    timed(Loop, "evaluate", "eval")
    timed(InferenceClient, "generate", "gen")
    timed(InferenceClient, "generate_many", "gen")
    timed_train_step(Trainers)
    timed(WeightSync, "push", "sync")
    timed(RewardPool, "score", "reward")
    if RewardModelClient is not None:
        timed(RewardModelClient, "_send", "judge")
    timed(Trainers, "export_for_servers", "export")  # the disk sync's export (older checkouts: Ranks.export)
    if not hasattr(Trainers, "export_for_servers"):
        timed(Trainers, "export", "export")
    timed(InferenceClient, "update_weights_from_disk", "load")
    timed(InferenceClient, "pause", "pause")
    timed(InferenceClient, "resume", "pause")


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    install()
    sys.argv = ["hpcrl.main", *overrides]
    try:  # as ``python -m hpcrl.main`` runs it (Hydra finds conf/ from the file of a __main__ module)
        runpy.run_module("hpcrl.main", run_name="__main__", alter_sys=True)
    finally:
        with open(out, "w") as f:
            json.dump(INTERVALS, f)


if __name__ == "__main__":
    main()
