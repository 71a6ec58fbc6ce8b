"""Message bodies to and from JSON, checked field by field against the dataclass annotations.

Supported annotations: ``int``, ``float`` (an int is accepted), ``str``, ``bool``, ``None`` and
``X | None``, ``list[X]``, ``dict[str, X]``, ``torch.Tensor`` and nested dataclasses. A tensor is
written as ``{"$tensor": index}``; its bytes travel outside the JSON (see ``wire.py``).

Errors name the path of the offending value, e.g. ``TrainStep.sequences[3].advantage``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

TENSOR_KEY = "$tensor"
_SCALARS = (int, float, str, bool)
_EXACT = frozenset(_SCALARS)  # a value of exactly one of these types is its own JSON, both ways


class FieldError(ValueError):
    """A value does not match its annotation; ``wire`` turns it into DecodeError or EncodeError."""


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of each dataclass field, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_annotation(ann: Any, where: str, is_known: Callable[[type], bool]) -> None:
    """Raise TypeError unless ``ann`` is one the wire can carry (called when a message is registered)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann in _SCALARS or ann is type(None) or ann is torch.Tensor:
        return
    if dataclasses.is_dataclass(ann) and isinstance(ann, type):
        if not is_known(ann):
            raise TypeError(f"{where}: nested dataclass {ann.__name__} must be registered too")
        return
    if _optional_arg(ann) is not None:
        return check_annotation(_optional_arg(ann), where, is_known)
    if origin is list and len(args) == 1:
        return check_annotation(args[0], f"{where}[]", is_known)
    if origin is dict and len(args) == 2 and args[0] is str:
        return check_annotation(args[1], f"{where}{{}}", is_known)
    raise TypeError(
        f"{where}: annotation {ann!r} is not supported on the wire; use int, float, str, bool, None, "
        "X | None, list[X], dict[str, X], torch.Tensor or a registered dataclass"
    )


@functools.cache  # annotations are few and hashable; typing's introspection is slow enough to matter per call
def _origin_args(ann: Any) -> tuple[Any, tuple]:
    return typing.get_origin(ann), typing.get_args(ann)


@functools.cache
def _optional_arg(ann: Any) -> Any:
    """``X`` for ``X | None`` / ``Optional[X]``, else None."""
    if typing.get_origin(ann) not in (types.UnionType, typing.Union):
        return None
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    return args[0] if len(args) == 1 and len(typing.get_args(ann)) == 2 else None


def _kind(value: Any) -> str:
    return type(value).__name__


def to_json(value: Any, ann: Any, path: str, tensors: list[torch.Tensor]) -> Any:
    """``value`` as JSON-able data; tensors are appended to ``tensors`` and replaced by a reference."""
    if ann is int or ann is bool or ann is str:
        if type(value) is not ann and not (ann is int and isinstance(value, int) and not isinstance(value, bool)):
            raise FieldError(f"{path}: expected {ann.__name__}, got {_kind(value)}")
        return value
    if ann is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise FieldError(f"{path}: expected float, got {_kind(value)}")
        return float(value)
    if ann is type(None) or value is None:
        if value is not None or (ann is not type(None) and _optional_arg(ann) is None):
            raise FieldError(f"{path}: expected {_name(ann)}, got {_kind(value)}")
        return None
    if ann is torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise FieldError(f"{path}: expected torch.Tensor, got {_kind(value)}")
        tensors.append(value)
        return {TENSOR_KEY: len(tensors) - 1}
    if (inner := _optional_arg(ann)) is not None:
        return to_json(value, inner, path, tensors)
    origin, args = _origin_args(ann)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise FieldError(f"{path}: expected a list, got {_kind(value)}")
        if args[0] in _SCALARS and all(type(v) is args[0] for v in value):
            return list(value)  # fast path for long token and logprob lists
        return [to_json(v, args[0], f"{path}[{i}]", tensors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(f"{path}: expected a dict, got {_kind(value)}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise FieldError(f"{path}: dict keys must be str, got {bad[0]!r}")
        return {k: to_json(v, args[1], f"{path}[{k!r}]", tensors) for k, v in value.items()}
    if not isinstance(value, ann):
        raise FieldError(f"{path}: expected {_name(ann)}, got {_kind(value)}")
    out = {}
    for name, t in field_types(ann).items():
        v = getattr(value, name)
        # the common case without a call or a path string: a scalar of exactly its annotated type
        out[name] = v if type(v) is t and t in _EXACT else to_json(v, t, f"{path}.{name}", tensors)
    return out


def from_json(data: Any, ann: Any, path: str, tensors: list[torch.Tensor], used: set[int]) -> Any:
    """Build a value of type ``ann`` from JSON ``data``; ``used`` collects the tensor indices referenced."""
    if ann is int:
        if type(data) is not int:
            raise FieldError(f"{path}: expected int, got {_json_kind(data)}")
        return data
    if ann is float:
        if type(data) is float:
            return data
        if type(data) is not int:
            raise FieldError(f"{path}: expected float, got {_json_kind(data)}")
        try:
            return float(data)
        except OverflowError:
            raise FieldError(f"{path}: integer {str(data)[:20]}... is too large for a float") from None
    if ann is str or ann is bool:
        if type(data) is not ann:
            raise FieldError(f"{path}: expected {ann.__name__}, got {_json_kind(data)}")
        return data
    if data is None:
        if ann is type(None) or _optional_arg(ann) is not None:
            return None
        raise FieldError(f"{path}: expected {_name(ann)}, got null")
    if ann is type(None):
        raise FieldError(f"{path}: expected null, got {_json_kind(data)}")
    if ann is torch.Tensor:
        return _tensor_ref(data, path, tensors, used)
    if (inner := _optional_arg(ann)) is not None:
        return from_json(data, inner, path, tensors, used)
    origin, args = _origin_args(ann)
    if origin is list:
        if type(data) is not list:
            raise FieldError(f"{path}: expected a list, got {_json_kind(data)}")
        if args[0] in _SCALARS and all(type(v) is args[0] for v in data):
            return data
        return [from_json(v, args[0], f"{path}[{i}]", tensors, used) for i, v in enumerate(data)]
    if origin is dict:
        if type(data) is not dict:
            raise FieldError(f"{path}: expected an object, got {_json_kind(data)}")
        return {k: from_json(v, args[1], f"{path}[{k!r}]", tensors, used) for k, v in data.items()}
    return dataclass_from_json(data, ann, path, tensors, used)


def dataclass_from_json(data: Any, cls: type, path: str, tensors: list[torch.Tensor], used: set[int]) -> Any:
    """An instance of dataclass ``cls`` from a JSON object holding exactly its fields."""
    if type(data) is not dict:
        raise FieldError(f"{path}: expected an object with the fields of {cls.__name__}, got {_json_kind(data)}")
    fields = field_types(cls)
    missing, extra = [n for n in fields if n not in data], [n for n in data if n not in fields]
    if missing or extra:
        raise FieldError(
            f"{path}: fields of {cls.__name__} do not match: missing {missing}, unexpected {extra[:5]}; "
            f"expected exactly {list(fields)}"
        )
    values = {}
    for n, t in fields.items():
        v = data[n]
        values[n] = v if type(v) is t and t in _EXACT else from_json(v, t, f"{path}.{n}", tensors, used)
    try:
        return cls(**values)
    except Exception as e:  # a __post_init__ check of the message itself
        raise FieldError(f"{path}: {cls.__name__} rejected its fields: {type(e).__name__}: {e}") from None


def _tensor_ref(data: Any, path: str, tensors: list[torch.Tensor], used: set[int]) -> torch.Tensor:
    if type(data) is not dict or list(data) != [TENSOR_KEY] or type(data[TENSOR_KEY]) is not int:
        raise FieldError(f'{path}: expected a tensor reference {{"{TENSOR_KEY}": index}}, got {_json_kind(data)}')
    index = data[TENSOR_KEY]
    if not 0 <= index < len(tensors):
        raise FieldError(f"{path}: tensor index {index} is outside the table of {len(tensors)} tensors")
    if index in used:
        raise FieldError(f"{path}: tensor {index} is referenced twice")
    used.add(index)
    return tensors[index]


def _json_kind(data: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an int", float: "a float"}
    return names.get(type(data), _kind(data))


def _name(ann: Any) -> str:
    return getattr(ann, "__name__", None) or str(ann)
