"""Resumable sharded checkpoints of an ``Engine``: model, optimizer, LR schedule and step.

Tensors go through torch.distributed.checkpoint (DCP): every rank writes its own shards in parallel, and
a checkpoint loads onto any world size. The small rest (step, scheduler state) is ``trainer_state.json``.
Everything is written under ``<dir>.partial`` and renamed to ``<dir>`` by rank 0 once every rank has
finished, so ``<dir>`` is either a whole checkpoint or absent. A crash during the final rename (a few
syscalls) can leave the previous checkpoint at ``<dir>.old``.

Durable before it is published: every rank fsyncs the files it wrote (DCP's ``sync_files``), rank 0 writes
``trainer_state.json`` with an fsync, fsyncs the directory (its entries, the other ranks' files among them),
renames it and fsyncs the parent, so a node that crashes after ``save_checkpoint`` returns cannot lose a
part of it. ``check_checkpoint`` finds what a crash or a full disk left missing or short, without loading.

With LoRA (``train.lora.rank > 0``) the model part is the adapter alone, beside its optimizer state: the frozen
base is the model directory's and is not copied into every checkpoint. ``trainer_state.json`` records the
adapter's shape (``lora``: null for full weights), and a checkpoint loads only into a run with the same.

The directory must be on a filesystem all ranks share (on a cluster: the run directory).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from hpcrl.config.schema import LoRAConfig
from hpcrl.rundir import fsync_dir
from hpcrl.train import lora
from hpcrl.train.engine import Engine, run_on_main

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


def save_checkpoint(engine: Engine, directory: str | Path) -> Path:
    """Write ``engine``'s full training state to ``directory`` (replacing one there). Collective."""
    import torch.distributed.checkpoint as dcp

    _, _, scheduler, info = _parts(engine)
    final = Path(directory)
    partial = final.with_name(final.name + ".partial")
    run_on_main(info, lambda: shutil.rmtree(partial, ignore_errors=True), what=f"clearing {partial}")
    model_state, optim_state = _state_dicts(engine)
    # DCP coordinates (plans, the final barrier) over the gloo meta group, never the NCCL one
    writer = dcp.FileSystemWriter(partial, sync_files=True)  # every rank fsyncs each file it writes
    dcp.save({"model": model_state, "optim": optim_state}, storage_writer=writer, process_group=info.meta_group)
    trainer_state = {
        "step": engine.step,
        "world_size": info.world_size,
        "scheduler": scheduler.state_dict(),
        "lora": _lora_record(engine.train.lora),
    }

    def publish() -> None:
        write_synced(partial / STATE_FILE, json.dumps(trainer_state, indent=1))
        fsync_dir(partial)  # the entries of every rank's files, and of the metadata DCP renamed into place
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        partial.rename(final)
        fsync_dir(final.parent)  # the renames
        shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint of step %d to %s", engine.step, final)

    run_on_main(info, publish, what=f"publishing checkpoint {final}")
    return final


def load_checkpoint(engine: Engine, directory: str | Path) -> None:
    """Restore ``engine`` (after ``setup()``) from a checkpoint written by ``save_checkpoint``. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optimizer, scheduler, info = _parts(engine)
    path = Path(directory)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: {STATE_FILE} is missing. A directory ending in .partial "
            "is an interrupted save; resume from an earlier checkpoint"
        )
    trainer_state = json.loads(state_file.read_text())
    if problem := lora_problem(trainer_state, engine.train.lora):
        raise ValueError(f"checkpoint {path}: {problem}")
    # get_state_dict gives correctly sharded templates (it initialises empty optimizer state first)
    model_state, optim_state = _state_dicts(engine)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path, process_group=info.meta_group)
    options = _options(engine)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    scheduler.load_state_dict(trainer_state["scheduler"])
    apply_settings(engine)
    engine.step = int(trainer_state["step"])
    logger.info(
        "loaded checkpoint of step %d from %s (saved by %d rank(s), loaded on %d)",
        engine.step,
        path,
        trainer_state["world_size"],
        info.world_size,
    )


def lora_problem(trainer_state: dict, lora: LoRAConfig) -> str | None:
    """Why a checkpoint (its ``trainer_state.json``, read) cannot load into a run with ``train.lora``, or None.

    A LoRA checkpoint holds an adapter and no base weights; a full one holds no adapter; adapters of another
    rank, scale or set of targets are another model. Dropout changes no weight, so it may differ."""
    saved, ours = trainer_state.get("lora"), _lora_record(lora)  # older checkpoints: full weights, no "lora"
    if saved == ours:
        return None
    if ours is None:
        return (
            f"it holds a LoRA adapter ({_describe(saved)}) and no full weights; this run trains full weights "
            "(train.lora.rank=0): resume with the checkpoint's train.lora settings"
        )
    if saved is None:
        return (
            f"it holds full weights and no LoRA adapter; this run trains a LoRA adapter ({_describe(ours)}): "
            "resume with train.lora.rank=0, or start a new run"
        )
    return f"its LoRA adapter is {_describe(saved)}, this run's train.lora is {_describe(ours)}: resume with the same"


def checkpoint_lora_problem(directory: str | Path, lora: LoRAConfig) -> str | None:
    """``lora_problem`` of the checkpoint in ``directory`` (reading its ``trainer_state.json`` alone, no collective):
    whether a run with ``train.lora`` can resume from it, checked before any trainer starts. None also when the
    state file cannot be read: ``check_checkpoint`` says what is wrong with it."""
    try:
        trainer_state = json.loads((Path(directory) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return lora_problem(trainer_state, lora) if isinstance(trainer_state, dict) else None


def _lora_record(lora: LoRAConfig) -> dict | None:
    """What decides the adapter's tensors and their meaning; None for full fine-tuning."""
    if lora.rank <= 0:
        return None
    return {"rank": lora.rank, "alpha": float(lora.alpha), "target_modules": sorted(lora.target_modules)}


def _describe(record: Any) -> str:
    return f"rank {record['rank']}, alpha {record['alpha']:g}, target_modules {record['target_modules']}"


def _state_dicts(engine: Engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state dicts (sharded, as DCP saves them); with LoRA the adapters' alone."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer, _, _ = _parts(engine)
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(engine))
    if engine.lora:  # ignore_frozen_params keeps a frozen weight tied under a second name (lm_head): drop it too
        trainable = lora.adapter_names(model)
        model_state = {name: tensor for name, tensor in model_state.items() if name in trainable}
    return model_state, optim_state


def _options(engine: Engine):
    """With LoRA the frozen base stays out of the checkpoint; loading then sets the adapters alone (not strict:
    the base's keys are absent by design; DCP still fails on an adapter key the checkpoint lacks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=engine.lora, strict=not engine.lora)


def apply_settings(engine: Engine) -> None:
    """The engine's own settings over a loaded checkpoint's: torch restores each param group's ``lr``,
    ``initial_lr`` and ``weight_decay`` (``Optimizer.load_state_dict``) and the schedule's ``base_lrs`` and last
    rate (``LRScheduler.load_state_dict``), so a run resumed with a new ``train.lr`` or ``train.weight_decay``
    would train on with the old ones. The rate of the next update is the new lr times the schedule's factor at the
    restored update count (the schedule built from this run's settings: warm-up, cosine over ``run.max_steps``)."""
    optimizer, scheduler = engine.optimizer, engine.scheduler
    assert optimizer is not None and scheduler is not None
    lr = engine.train.lr
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"], group["weight_decay"] = lr, engine.train.weight_decay
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def write_synced(path: Path, text: str) -> None:
    """Write ``path`` and fsync it (the caller fsyncs its directory once its other entries are in place)."""
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def check_checkpoint(directory: str | Path) -> str | None:
    """What is wrong with the trainers' part of a checkpoint, or None when every part is there, whole.

    Reads ``trainer_state.json`` and DCP's metadata (no collective, no model), and checks that every file the
    metadata names is there and long enough for every tensor it holds: a deleted or truncated part is found
    before any trainer tries to load it.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(directory)
    try:
        trainer_state = json.loads((path / STATE_FILE).read_text())
        if not isinstance(trainer_state.get("scheduler"), dict):  # and the step: what load_checkpoint reads
            raise KeyError("scheduler")
        int(trainer_state["step"])
    except FileNotFoundError:
        return f"{STATE_FILE} is missing"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{STATE_FILE} is not a trainer state ({type(e).__name__}: {e}); the file may be cut short"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # missing, or cut short: pickle raises several kinds
        return f"the tensors' metadata (.metadata) cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"the tensor file {name} is missing"
        if file.stat().st_size < size:
            return f"the tensor file {name} is cut short: {file.stat().st_size} bytes, its tensors need {size}"
    return None


def _parts(engine: Engine):
    model, info = engine.require_setup()
    if engine.optimizer is None or engine.scheduler is None:
        raise RuntimeError("Engine.setup() has not run; call it before saving or loading a checkpoint")
    return model, engine.optimizer, engine.scheduler, info
