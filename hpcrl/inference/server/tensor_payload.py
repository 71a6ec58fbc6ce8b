"""SGLang's serialized named tensors, as its HTTP routes take them (``serialized_named_tensors``).

SGLang 0.5.23 encodes them with its ``MultiprocessingSerializer``: ``multiprocessing``'s ``ForkingPickler``
(which ``torch.multiprocessing`` teaches to send a tensor's storage as shared memory: a file descriptor
handed over by the sending process, or a file name), then base64 for JSON; such a payload is only valid while
the sender lives, on the same host, as for SGLang. A plain pickle carries each storage's bytes inline
(``torch.storage._load_from_bytes``), which SGLang reads with ``torch.load(..., weights_only=True)``, as
here: that is what a trainer on another node sends. Unpickling runs with an allow-list of globals (torch's
tensor and storage rebuilders, dtypes, plain containers) as SGLang's ``SafeUnpickler`` does: a payload naming
anything else is refused, never run.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

import torch
import torch.multiprocessing

_REBUILDERS = {
    "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter"},
    "torch._tensor": {"_rebuild_from_type_v2"},
    "torch.multiprocessing.reductions": {
        "rebuild_tensor",
        "rebuild_storage_fd",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
    },
    "torch.nn.parameter": {"Parameter"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", "device", "UntypedStorage"},
    "multiprocessing.resource_sharer": {"DupFd"},
    "collections": {"OrderedDict"},
    "builtins": {"dict", "list", "tuple", "str", "int", "float", "bool", "bytes", "set", "frozenset"},
    "copyreg": {"__newobj__"},
}


class PayloadError(ValueError):
    """A payload that is not base64 of a pickle this module accepts, or not a dict of named tensors."""


def _storage_from_bytes(data: bytes):
    """``torch.storage._load_from_bytes`` without its unrestricted ``torch.load``: a storage, or an error."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)):
        raise PayloadError(f"expected a torch storage in the pickle, got {type(storage).__name__}")
    return storage


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if name in _REBUILDERS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise PayloadError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def decode_named_tensors(payload: Any) -> dict[str, torch.Tensor]:
    """One rank's payload (a base64 string) as ``{name: tensor}``, the form SGLang's LoRA loader iterates."""
    if not isinstance(payload, str):
        raise PayloadError(f"a serialized tensor payload must be a base64 string, got {type(payload).__name__}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PayloadError(f"the serialized tensors are not valid base64: {e}") from None
    try:
        obj = _AllowListUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as e:  # a truncated pickle, or shared memory whose sender has gone
        raise PayloadError(f"the serialized tensors cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise PayloadError(f"the serialized tensors must be a dict of name -> tensor, got {type(obj).__name__}")
    return obj


def encode_named_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """The payload SGLang's ``MultiprocessingSerializer.serialize(tensors, output_str=True)`` makes, for a server
    on this host that is no child of this process: CPU storages go by shared-memory file name (torch's
    ``file_system`` strategy, set for this process), since a file descriptor is handed only to processes that
    share this one's ``multiprocessing`` auth key."""
    from multiprocessing.reduction import ForkingPickler

    torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(tensors)
    return base64.b64encode(buf.getvalue()).decode()
