"""The RPC frame: one typed message with its tensors as raw bytes. No pickle.

Layout (integers big-endian)::

    offset 0   magic     4 bytes  b"HRPC"
           4   version   u16      1
           6   header    u32      length H of the JSON header, including its padding
          10   data      u64      length D of the tensor data region
          18   JSON header, UTF-8, padded with spaces so the data region starts on a 64-byte boundary
      18 + H   tensor data: tensor i at data offset ``offset_i``, each offset aligned to 64 bytes

The header is ``{"type": <registered name>, "body": {...}, "tensors": [{dtype, shape, offset, nbytes}]}``,
as Python's ``json`` writes it (NaN and +-Infinity allowed, so float fields carry them).
In the body a tensor is ``{"$tensor": i}``. The data layout is fixed:
offsets are the previous tensor's end rounded up to 64, ``nbytes == prod(shape) * itemsize``, the data
region ends where the last tensor ends, and the frame ends where the data region ends. Decoding checks
all of this against the bytes and the message's dataclass annotations, and raises only DecodeError.

Tensors travel as their raw CPU bytes through a uint8 view, so every dtype (bfloat16 included) is kept
bit-exact. ``encode_parts`` returns the header and zero-copy views of each tensor for the transport to
write one after the other; a decoded tensor shares memory with a writable input buffer.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from hpcrl.rpc.fields import FieldError, dataclass_from_json, to_json
from hpcrl.rpc.messages import MESSAGES

MAGIC = b"HRPC"
VERSION = 1
ALIGN = 64
_PRELUDE = struct.Struct(">4sHIQ")
_HEADER_KEYS = ["type", "body", "tensors"]
_TENSOR_KEYS = ["dtype", "shape", "offset", "nbytes"]
_HEADER_KEY_SET, _TENSOR_KEY_SET = set(_HEADER_KEYS), set(_TENSOR_KEYS)
_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder, not one per frame (json.dumps with options)
_DTYPE_NAMES = [
    *("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "bool"),
    *("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64"),
    *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"),
]
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_DTYPE_NAME = {d: n for n, d in DTYPES.items()}

Buffer = bytes | bytearray | memoryview


class DecodeError(ValueError):
    """The bytes are not a valid frame for a registered message; the message says what was wrong."""


class EncodeError(TypeError):
    """The message cannot be put on the wire (unregistered type, field of the wrong type, GPU tensor...)."""


def encode(msg: Any) -> bytes:
    """The whole frame as one bytes object (a transport should prefer ``encode_parts``)."""
    return b"".join(encode_parts(msg))


def encode_parts(msg: Any) -> list[Buffer]:
    """The frame as a list of buffers to write in order: header, then each tensor's bytes (not copied)."""
    name = type(msg).__name__
    if MESSAGES.get(name) is not type(msg):
        raise EncodeError(f"{type(msg).__qualname__} is not a registered message; decorate it with @register")
    tensors: list[torch.Tensor] = []
    try:
        body = to_json(msg, type(msg), name, tensors)
    except FieldError as e:
        raise EncodeError(str(e)) from None
    table, views, end = [], [], 0
    for i, t in enumerate(tensors):
        view = _raw_bytes(t, f"{name} tensor {i}")
        offset = _align(end)
        table.append({"dtype": _DTYPE_NAME[t.dtype], "shape": list(t.shape), "offset": offset, "nbytes": len(view)})
        views.append((offset - end, view))
        end = offset + len(view)
    header = _JSON.encode({"type": name, "body": body, "tensors": table}).encode()
    header += b" " * (_align(_PRELUDE.size + len(header)) - _PRELUDE.size - len(header))
    parts: list[Buffer] = [_PRELUDE.pack(MAGIC, VERSION, len(header), end) + header]
    for pad, view in views:
        if pad:
            parts.append(bytes(pad))
        parts.append(view)
    return parts


def decode(data: Buffer, expected: type | None = None) -> Any:
    """The message in ``data``; raises DecodeError (and nothing else) when the frame is not valid."""
    try:
        return _decode(data, expected)
    except DecodeError:
        raise
    except FieldError as e:
        raise DecodeError(str(e)) from None
    except (RecursionError, MemoryError, ValueError, TypeError, OverflowError, RuntimeError) as e:
        raise DecodeError(f"malformed frame: {type(e).__name__}: {e}") from None


def _decode(data: Buffer, expected: type | None) -> Any:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected bytes, bytearray or memoryview, got {type(data).__name__}")
    buf = memoryview(data).cast("B")
    if len(buf) < _PRELUDE.size:
        raise DecodeError(f"frame is {len(buf)} bytes, shorter than the {_PRELUDE.size}-byte prelude")
    magic, version, header_len, data_len = _PRELUDE.unpack(buf[: _PRELUDE.size])
    if magic != MAGIC:
        raise DecodeError(f"not an hpcrl RPC frame: magic is {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise DecodeError(f"frame version {version} is not supported; this side speaks version {VERSION}")
    start = _PRELUDE.size + header_len
    if start % ALIGN:
        raise DecodeError(f"header length {header_len} does not end on a {ALIGN}-byte boundary")
    if len(buf) < start + data_len:
        raise DecodeError(f"frame truncated: it declares {start + data_len} bytes but only {len(buf)} arrived")
    if len(buf) > start + data_len:
        raise DecodeError(f"{len(buf) - start - data_len} trailing bytes after the {start + data_len}-byte frame")
    header = _parse_header(bytes(buf[_PRELUDE.size : start]))
    cls = MESSAGES.get(header["type"]) if isinstance(header["type"], str) else None
    if cls is None:
        raise DecodeError(f"unknown message type {header['type']!r}; known: {sorted(MESSAGES)[:50]}")
    if expected is not None and cls is not expected:
        raise DecodeError(f"expected a {expected.__name__} message, got {cls.__name__}")
    tensors = _tensors(header["tensors"], buf[start:], data_len)
    used: set[int] = set()
    msg = dataclass_from_json(header["body"], cls, cls.__name__, tensors, used)
    if len(used) != len(tensors):
        raise DecodeError(f"tensor table has {len(tensors)} entries but the body references {len(used)}")
    return msg


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DecodeError(f"header is not UTF-8: {e}") from None
    except (ValueError, RecursionError) as e:
        raise DecodeError(f"header is not valid JSON: {str(e)[:200]}") from None
    if type(header) is not dict or header.keys() != _HEADER_KEY_SET:
        keys = sorted(header) if type(header) is dict else type(header).__name__
        raise DecodeError(f"header must be an object with keys {_HEADER_KEYS}, got {keys}")
    return header


def _tensors(table: Any, region: memoryview, data_len: int) -> list[torch.Tensor]:
    if type(table) is not list:
        raise DecodeError(f"tensor table must be a list, got {type(table).__name__}")
    tensors, end = [], 0
    for i, entry in enumerate(table):
        if type(entry) is not dict or entry.keys() != _TENSOR_KEY_SET:
            raise DecodeError(f"tensor {i}: entry must be an object with keys {_TENSOR_KEYS}")
        dtype, shape, offset, nbytes = (entry[k] for k in _TENSOR_KEYS)
        if type(dtype) is not str or dtype not in DTYPES:
            raise DecodeError(f"tensor {i}: unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise DecodeError(f"tensor {i}: shape must be a list of non-negative ints, got {shape!r}")
        if type(offset) is not int or offset != _align(end):
            raise DecodeError(f"tensor {i}: offset {offset!r} should be {_align(end)} (previous end aligned)")
        itemsize = DTYPES[dtype].itemsize
        if type(nbytes) is not int or nbytes != math.prod(shape) * itemsize:
            raise DecodeError(f"tensor {i}: nbytes {nbytes!r} != prod(shape {shape}) * itemsize {itemsize}")
        end = offset + nbytes
        if end > data_len:
            raise DecodeError(f"tensor {i}: bytes {offset}..{end} run past the {data_len}-byte data region")
        tensors.append(_tensor(region[offset:end], DTYPES[dtype], shape, i))
    if end != data_len:
        raise DecodeError(f"data region is {data_len} bytes but the tensors end at {end}")
    return tensors


def _tensor(raw: memoryview, dtype: torch.dtype, shape: list[int], i: int) -> torch.Tensor:
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    if raw.readonly:  # torch.frombuffer needs a writable buffer to share memory; copy this one
        raw = memoryview(bytearray(raw))
    u8 = torch.frombuffer(raw, dtype=torch.uint8)
    if dtype is torch.bool and bool((u8 > 1).any()):
        raise DecodeError(f"tensor {i}: a bool tensor holds bytes other than 0 and 1")
    return u8.view(dtype).reshape(shape)


def _raw_bytes(t: torch.Tensor, what: str) -> memoryview:
    """The tensor's bytes as a flat uint8 memoryview, without copying when it is already contiguous."""
    if t.device.type != "cpu" or t.layout is not torch.strided:
        raise EncodeError(f"{what}: only dense CPU tensors travel; got {t.device} {t.layout}, call .cpu() first")
    if t.dtype not in _DTYPE_NAME:
        raise EncodeError(f"{what}: dtype {t.dtype} is not supported; supported: {sorted(DTYPES)}")
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data  # uint8 is plain bytes to numpy, whatever the dtype


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
