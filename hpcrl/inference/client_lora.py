"""SGLang's LoRA adapter calls: the adapter's name, its tensors as SGLang 0.5.23 decodes them, and its answers.

``/load_lora_adapter_from_tensors`` (``LoadLoRAAdapterFromTensorsReqInput``) takes ``serialized_named_tensors``:
one base64 string per tensor-parallel rank of the server, each rank decoding only its own copy
(``tp_worker.deserialize_own_rank``) with ``MultiprocessingSerializer.deserialize``, i.e. a pickle read by
SGLang's ``SafeUnpickler``, into the ``{name: tensor}`` dict its LoRA loader iterates. SGLang's own ``Engine``
pickles with ``ForkingPickler``, whose tensors are handles to shared memory or CUDA IPC: readable only on the
same node, while the sender lives. hpcrl's trainer is on another node, so the tensors are pickled plainly
(their bytes inline, through ``torch.storage._load_from_bytes``, which ``SafeUnpickler`` allows), on the CPU,
each with a storage of its own (a view would carry its whole base storage).

Every LoRA route answers ``LoRAUpdateOutput`` (``success``, ``error_message``, ``loaded_adapters``): HTTP 200 on
success, 400 with ``success`` false and the reason otherwise.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

from hpcrl.inference.client_http import InferenceError

PICKLE_PROTOCOL = 4  # readable by every Python SGLang runs on, whatever the trainer's Python writes by default


def check_adapter_name(name: Any) -> str:
    """A name a request can give as ``lora_path``: SGLang serves the base model for an empty one."""
    if not isinstance(name, str) or not name:
        expected = "a non-empty string (SGLang reads '' as the base model)"
        raise ValueError(f"a LoRA adapter's name must be {expected}, got {name!r}")
    return name


def serialized_tensors(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], copies: int) -> list[str]:
    """``copies`` (one per tensor-parallel rank) base64 pickles of ``{name: tensor}`` as SGLang decodes them: the
    module's docstring says how. ``named_tensors`` is a mapping or ``(name, tensor)`` pairs of full tensors."""
    import torch

    pairs = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    if not pairs:
        raise ValueError("named_tensors is empty; an adapter needs its lora_A and lora_B tensors")
    tensors: dict[str, Any] = {}
    for name, tensor in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tensor's name must be a non-empty string, got {name!r}")
        if name in tensors:
            raise ValueError(f"named_tensors names {name!r} twice")
        plain = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor
        if type(plain) is not torch.Tensor:
            raise ValueError(
                f"tensor {name!r} is a {type(tensor).__name__}, expected a full torch.Tensor (a DTensor's "
                "full_tensor()): SGLang's unpickler takes plain tensors only"
            )
        tensors[name] = plain.cpu().clone(memory_format=torch.contiguous_format)
    payload = base64.b64encode(pickle.dumps(tensors, protocol=PICKLE_PROTOCOL)).decode("ascii")
    return [payload] * copies


def checked_config(config_dict: Any) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` as a dict, refused unless it is JSON (PEFT's ``to_dict`` holds a set)."""
    if not isinstance(config_dict, dict):
        kind = type(config_dict).__name__
        raise ValueError(f"config_dict must be the adapter's adapter_config.json as a dict, got a {kind}")
    try:
        json.dumps(config_dict)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"config_dict must hold JSON values only, as adapter_config.json does (PEFT's save_pretrained writes "
            f"target_modules as a list): {e}"
        ) from None
    return config_dict


def check_lora_update(server: str, endpoint: str, answer: Any) -> None:
    """Refuse an answer that is not ``LoRAUpdateOutput`` with ``success`` true, naming SGLang's reason."""
    if isinstance(answer, dict) and answer.get("success") is True:
        return
    reason = answer.get("error_message") if isinstance(answer, dict) else None
    raise InferenceError(
        f"POST {endpoint} on {server} reported failure: {reason if reason else str(answer)[:500]}",
        server=server,
        endpoint=endpoint,
    )
