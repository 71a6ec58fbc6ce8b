"""LoRA on the policy (``train.lora.rank > 0``): peft's adapters, wrapped around the model before FSDP2 shards it.

Only the adapters train: peft freezes every other weight (``requires_grad=False``), so autograd never computes
their gradients and the optimizer holds the adapters alone. What leaves the trainer is PEFT's layout: the tensor
names ``get_peft_model_state_dict`` gives (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)
in ``adapter_model.safetensors`` and the adapter's config in ``adapter_config.json``: what
``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read, and what
``/load_lora_adapter_from_tensors`` takes as ``config_dict`` and tensors.

The KL penalty's reference is the base model, which is the policy with its adapters switched off
(``BaseReference``): no second copy of the model.

peft and transformers are imported inside the functions: the controller checks targets before launch without
loading them at import.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hpcrl.config.schema import LoRAConfig
from hpcrl.rpc.messages import register

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file names (peft.utils.constants), which SGLang reads too
ADAPTER_WEIGHTS = "adapter_model.safetensors"
INIT_SEED = 0  # the adapters' initial draw, the same on every rank and in every run of a model


def peft_config(lora: LoRAConfig, base_path: str | Path = ""):
    """peft's ``LoraConfig`` for ``train.lora``; ``base_path`` is recorded as the adapter's base model."""
    from peft import LoraConfig

    # peft types lora_alpha as an int and writes it so: a whole alpha goes as one (a fractional one scales right too)
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return LoraConfig(
        r=lora.rank,
        lora_alpha=alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_path) or None,
    )


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's Linear modules (``q_proj``, ``lm_head``, ...), sorted."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})


def targets_problem(model: nn.Module, targets: list[str]) -> str | None:
    """One line naming the first target that matches no Linear module of ``model``, or None when all match.

    A target matches a module named exactly so or ending in ``.<target>``, as peft matches a list of names.
    peft itself fails only when no target matches at all; a misspelt one beside good ones would be ignored.
    """
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in names):
            return (
                f"train.lora.target_modules: {target!r} matches no Linear module of the model "
                f"({type(model).__name__}); its Linear modules are named {linear_names(model)}"
            )
    return None


def lora_targets_problem(model: str | Path | Any, targets: list[str]) -> str | None:
    """``targets_problem`` for a model directory (or its transformers config), built on the meta device: no
    weights are read or allocated, so the controller can call it before launch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = model if not isinstance(model, str | Path) else AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return targets_problem(skeleton, targets)


def wrap(model: nn.Module, lora: LoRAConfig, base_path: str | Path) -> nn.Module:
    """``model`` as a peft model with ``lora``'s adapters, every other weight frozen; ValueError (one line) for a
    target that matches nothing. Call it before ``fully_shard``: FSDP2 then shards adapters and frozen weights
    alike and reduces the gradients of the adapters only.

    The adapters' random start (``lora_A``; ``lora_B`` is zero) is drawn from ``INIT_SEED`` on the CPU, whatever
    the process drew before: every rank shards its own copy, and copies drawn apart would be pieces of different
    adapters. The caller's random state is left as it was."""
    from peft import get_peft_model

    if problem := targets_problem(model, lora.target_modules):
        raise ValueError(problem)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        return get_peft_model(model, peft_config(lora, base_path))


def is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_config(model: Any) -> dict[str, Any]:
    """The adapter's config as PEFT writes ``adapter_config.json`` (JSON types only, ``inference_mode`` true):
    SGLang's ``config_dict``."""
    config = copy.copy(model.peft_config["default"])
    config.inference_mode = True
    # sets (target_modules) become sorted lists, so the file is the same from run to run; PeftType is a str
    return json.loads(json.dumps(config.to_dict(), default=sorted))


def adapter_names(model: nn.Module) -> set[str]:
    """The state-dict names of the adapter's trainable tensors (the model's own names, ``...lora_A.default...``)."""
    return {name for name, param in model.named_parameters() if param.requires_grad}


def peft_names(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (the model's names, gathered) under PEFT's saved names, the adapter's tensors only."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=state)


def write_adapter(out: Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """``adapter_config.json`` and ``adapter_model.safetensors`` in ``out``, as ``PeftModel.save_pretrained``."""
    from safetensors.torch import save_file

    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def write_merged(out: Path, base_path: Path, adapter_dir: Path) -> None:
    """The base model from ``base_path`` with the adapter of ``adapter_dir`` merged in, in Hugging Face layout
    (no peft names left) in ``out``. The frozen base never changes, so it is read from disk, not gathered."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)


# ---- the adapter over the trainer RPC (the weight sync's payload for /load_lora_adapter_from_tensors) ----------


@register
@dataclasses.dataclass
class LoraAdapterRequest:
    """Ask every trainer rank for the adapter (collective: they gather it together; rank 0 answers with it)."""


@register
@dataclasses.dataclass
class LoraAdapter:
    config: str  # adapter_config.json's text (JSON of SGLang's config_dict)
    tensors: dict[str, Tensor]  # the adapter's float32 tensors by PEFT name on rank 0; {} on the other ranks
