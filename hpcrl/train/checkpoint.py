"""Resumable sharded checkpoints of an ``Engine``: model, optimizer, LR schedule and step.

Tensors go through torch.distributed.checkpoint (DCP): every rank writes its own shards in parallel, and
a checkpoint loads onto any world size. The small rest (step, scheduler state) is ``trainer_state.json``.
Everything is written under ``<dir>.partial`` and renamed to ``<dir>`` by rank 0 once every rank has
finished, so ``<dir>`` is either a whole checkpoint or absent. A crash during the final rename (a few
syscalls) can leave the previous checkpoint at ``<dir>.old``.

The directory must be on a filesystem all ranks share (on a cluster: the run directory).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from hpcrl.train.engine import Engine, run_on_main

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


def save_checkpoint(engine: Engine, directory: str | Path) -> Path:
    """Write ``engine``'s full training state to ``directory`` (replacing one there). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer, scheduler, info = _parts(engine)
    final = Path(directory)
    partial = final.with_name(final.name + ".partial")
    run_on_main(info, lambda: shutil.rmtree(partial, ignore_errors=True), what=f"clearing {partial}")
    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP coordinates (plans, the final barrier) over the gloo meta group, never the NCCL one
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=partial, process_group=info.meta_group)
    trainer_state = {"step": engine.step, "world_size": info.world_size, "scheduler": scheduler.state_dict()}

    def publish() -> None:
        (partial / STATE_FILE).write_text(json.dumps(trainer_state, indent=1))
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint of step %d to %s", engine.step, final)

    run_on_main(info, publish, what=f"publishing checkpoint {final}")
    return final


def load_checkpoint(engine: Engine, directory: str | Path) -> None:
    """Restore ``engine`` (after ``setup()``) from a checkpoint written by ``save_checkpoint``. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer, scheduler, info = _parts(engine)
    path = Path(directory)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: {STATE_FILE} is missing. A directory ending in .partial "
            "is an interrupted save; resume from an earlier checkpoint"
        )
    trainer_state = json.loads(state_file.read_text())
    # get_state_dict gives correctly sharded templates (it initialises empty optimizer state first)
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path, process_group=info.meta_group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(trainer_state["scheduler"])
    engine.step = int(trainer_state["step"])
    logger.info(
        "loaded checkpoint of step %d from %s (saved by %d rank(s), loaded on %d)",
        engine.step,
        path,
        trainer_state["world_size"],
        info.world_size,
    )


def _parts(engine: Engine):
    model, info = engine.require_setup()
    if engine.optimizer is None or engine.scheduler is None:
        raise RuntimeError("Engine.setup() has not run; call it before saving or loading a checkpoint")
    return model, engine.optimizer, engine.scheduler, info
