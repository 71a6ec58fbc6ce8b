"""A run's checkpoint as a model to evaluate (``run.max_steps=0 model.path=<run dir>/checkpoints/step_NNNNNN``).

A checkpoint holds the trainers' sharded state (``checkpoint.py``: DCP, with the optimizer's) and not the model's
config or tokenizer; those are the run's model directory, ``model.path`` in the run's ``config.yaml`` (a resume
cannot change the model, ``hpcrl.config.resume``). ``write_checkpoint_model`` loads the base model's architecture
from there, the checkpoint's model tensors into it (in one process: DCP loads onto any world size, here none), and
writes a Hugging Face directory the servers load, as ``final/`` is written.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hpcrl.errors import UserError

log = logging.getLogger(__name__)

RUN_CONFIG = "config.yaml"  # the run's own config, two levels above a step directory (<run dir>/checkpoints/step_N)


class NotACheckpoint(UserError):
    """A checkpoint directory that cannot be evaluated: incomplete, or its run's model cannot be found."""

    label = "checkpoint error"


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a trainers' checkpoint directory (it has the trainer state file) rather than a model."""
    from hpcrl.train.checkpoint import STATE_FILE

    return (Path(path).expanduser() / STATE_FILE).is_file()


def checkpoint_base_model(step_dir: str | Path) -> Path:
    """The model directory of the run that wrote ``step_dir``: its config.json, tokenizer and architecture."""
    from omegaconf import OmegaConf

    step = Path(step_dir).expanduser().absolute()
    config = step.parent.parent / RUN_CONFIG
    if not config.is_file():
        raise NotACheckpoint(f"{step}: its run's {RUN_CONFIG} is not at {config}; a checkpoint is read in its run dir")
    run = OmegaConf.load(config)
    lora = OmegaConf.select(run, "train.lora.rank", default=0)
    if lora:
        why = f"a LoRA run's checkpoint (train.lora.rank={lora}) holds its adapters only"
        raise NotACheckpoint(f"{step}: {why}; evaluate the run's export (final/ or exports/step_N) instead")
    path = OmegaConf.select(run, "model.path", default="") or ""
    if not path or not (Path(path) / "config.json").is_file():
        raise NotACheckpoint(f"{step}: its run's model directory (model.path={path!r} in {config}) has no config.json")
    return Path(path)


def checkpoint_problem(step_dir: str | Path) -> str | None:
    """What keeps ``step_dir`` from being evaluated, or None (read without loading any tensor)."""
    from hpcrl.train.checkpoint import check_checkpoint

    try:
        checkpoint_base_model(step_dir)  # its run's model: what the tensors are of
    except NotACheckpoint as e:
        return str(e)
    problem = check_checkpoint(step_dir)
    return None if problem is None else f"an incomplete checkpoint: {problem}"


def write_checkpoint_model(step_dir: str | Path, out: str | Path) -> Path:
    """Write the model of the checkpoint ``step_dir`` to ``out`` in Hugging Face layout (weights in float32, as the
    trainers hold them; the base model's config and tokenizer files beside them). Returns ``out``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from hpcrl.rundir import write_dir_atomic
    from hpcrl.train.engine import copy_non_weight_files

    step, target = Path(step_dir).expanduser().absolute(), Path(out)
    problem = checkpoint_problem(step)
    if problem is not None:
        raise NotACheckpoint(f"{step}: {problem}")
    base = checkpoint_base_model(step)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=step)  # the model's tensors only: the optimizer's are not asked for
    model.load_state_dict(state["model"])

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        copy_non_weight_files(base, tmp)

    write_dir_atomic(target, fill)
    log.info("the model of checkpoint %s (base %s) written to %s", step, base, target)
    return target
