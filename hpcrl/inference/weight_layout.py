"""The weight-update group's arithmetic and a push's buckets, without torch (the client and the controller
import this; torch would add seconds to every process that only speaks HTTP).

Ranks: the trainer is 0; every tensor-parallel rank of every server joins, server ``i``'s rank ``t`` as
``rank_offset_i + t``, with ``rank_offset_i = 1 + sum(tp_size of servers before i)`` and
``world_size = 1 + sum(tp_size)``. A push is one ``/update_weights_from_distributed`` call per bucket: a
receiver allocates a buffer for every tensor of a call before the first arrives (as SGLang does), so a
bucket's bytes are what a call costs it.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
Spec = tuple[str, str, list[int]]  # (name, dtype name such as "bfloat16", shape)
# bytes per element of the dtype names a push may carry (torch's names)
ITEM_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def group_layout(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """(world size, rank offset of each server) for servers of these tensor-parallel sizes, trainer at 0."""
    if not tp_sizes or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tp_sizes):
        raise ValueError(f"tp_sizes must be a non-empty list of integers >= 1, got {list(tp_sizes)}")
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp
    return next_rank, offsets


def spec_bytes(specs: Sequence[Spec]) -> int:
    """Bytes of the tensors ``specs`` describe: what a receiver allocates for one call."""
    total = 0
    for name, dtype, shape in specs:
        size = ITEM_BYTES.get(str(dtype).removeprefix("torch."))
        if size is None:
            raise ValueError(f"{name}: unknown dtype {dtype!r}; expected one of {', '.join(ITEM_BYTES)}")
        count = 1
        for dim in shape:
            count *= dim
        total += count * size
    return total


def buckets(specs: Sequence[Spec], max_bytes: int) -> list[list[Spec]]:
    """``specs`` in order, cut into runs of at most ``max_bytes`` each (a tensor larger than that alone):
    one ``/update_weights_from_distributed`` call per run."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    out: list[list[Spec]] = []
    size = 0
    for spec in specs:
        nbytes = spec_bytes([spec])
        if not out or size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(spec)
        size += nbytes
    return out
