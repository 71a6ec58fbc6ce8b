"""The torch side of the CPU server's LoRA adapters: PEFT's LoRA layers in the runner's model, one adapter each.

Adapters are injected with ``peft.inject_adapter_in_model`` under their registry id (a hex string: a name
such as ``v1.2`` would not do as a ``ModuleDict`` key) and filled from PEFT's tensors
(``base_model.model.<module>.lora_A.weight``, as ``save_pretrained`` writes them). Every forward names each
row's adapter (``ModelRunner.forward``: PEFT's ``adapter_names``, ``__base__`` for the base model), so one
batch mixes adapters and the base, and an adapter that is loaded is never applied to a row that did not ask
for it. Everything here runs on the runner's torch thread, between two decode steps.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from hpcrl.inference.server.runner import ModelRunner

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(config_dict: dict[str, Any]):
    """A ``peft.LoraConfig`` from an ``adapter_config.json`` dict; ValueError naming what is wrong."""
    from peft import LoraConfig

    fields = {k: v for k, v in config_dict.items() if k != "peft_type"}
    if config_dict.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type {config_dict.get('peft_type')!r} is not LORA")
    try:
        return LoraConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"adapter config is not a LoRA config PEFT reads: {e}") from None


def read_adapter_tensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT adapter directory (``adapter_model.safetensors``)."""
    from safetensors.torch import load_file

    file = Path(path) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ValueError(f"no {ADAPTER_WEIGHTS} in {path} (hpcrl's CPU server reads PEFT's safetensors layout only)")
    return load_file(file)


def add_adapter(runner: ModelRunner, adapter_id: str, config, tensors: dict[str, torch.Tensor]) -> None:
    """Inject adapter ``adapter_id`` and load its tensors; on any error nothing of it stays in the model."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(config, runner.model, adapter_name=adapter_id)
        runner.model.eval()  # the injected modules start in training mode: their lora_dropout would drop at random
        _load(runner.model, adapter_id, tensors)
    except Exception as e:
        remove_adapter(runner, adapter_id)
        raise ValueError(str(e)) from None
    runner.adapter_layers = _lora_layers(runner.model)


def remove_adapter(runner: ModelRunner, adapter_id: str) -> None:
    for layer in _lora_layers(runner.model):
        if adapter_id in layer.lora_A or adapter_id in layer.lora_B:
            layer.delete_adapter(adapter_id)
    runner.adapter_layers = _lora_layers(runner.model)


def _load(model: torch.nn.Module, adapter_id: str, tensors: dict[str, torch.Tensor]) -> None:
    """Copy PEFT-named tensors into the injected adapter: every one of its parameters, nothing else."""
    mine = {}
    for name, value in tensors.items():
        module, dot, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not dot or kind not in ("A.weight", "B.weight"):
            raise ValueError(f"adapter tensor {name!r} is not a LoRA A/B weight (lora_A.weight or lora_B.weight)")
        mine[f"{module}.lora_{kind[0]}.{adapter_id}.weight"] = value
    params = {k: v for k, v in model.state_dict().items() if f".{adapter_id}." in k}
    missing, unknown = sorted(set(params) - set(mine)), sorted(set(mine) - set(params))
    if unknown:
        raise ValueError(f"adapter tensors for modules the adapter does not target: {_names(unknown, adapter_id)}")
    if missing:
        raise ValueError(f"adapter tensors missing for: {_names(missing, adapter_id)}")
    with torch.no_grad():
        for key, value in mine.items():
            if params[key].shape != value.shape:
                raise ValueError(
                    f"{_names([key], adapter_id)[0]}: shape {tuple(value.shape)} does not match the adapter's "
                    f"{tuple(params[key].shape)} (rank and the base model's sizes)"
                )
            params[key].copy_(value.to(params[key].dtype))


def _names(keys: list[str], adapter_id: str) -> list[str]:
    shown = [PEFT_PREFIX + k.replace(f".{adapter_id}.", ".") for k in keys[:5]]
    return shown + (["..."] if len(keys) > 5 else [])


def _lora_layers(model: torch.nn.Module) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]
