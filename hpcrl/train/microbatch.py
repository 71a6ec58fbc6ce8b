"""Token-balanced micro-batches, and the same number of them on every rank.

``pack`` is pure: it splits one rank's sequences (by length) into micro-batches whose *padded* size
(sequences x longest sequence, what a right-padded tensor really allocates) stays within a token budget;
a single sequence longer than the budget gets a micro-batch of its own. Sequences go longest first, each
into the least-loaded micro-batch (by real tokens) it fits in, opening a new one when none fits.

Every FSDP forward/backward all-gathers and reduce-scatters, so every rank must run the same number of
them or the group hangs. ``plan`` agrees on the largest count over the gloo meta group; a rank with fewer
micro-batches splits its biggest ones (``equalize``) and, when nothing is left to split, adds empty ones,
which the engine runs as a forward/backward of zero weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


def padded_tokens(indices: Sequence[int], lengths: Sequence[int]) -> int:
    """Size of the right-padded ``[len(indices), longest]`` tensor of these sequences."""
    return len(indices) * max((lengths[i] for i in indices), default=0)


def pack(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches of at most ``max_tokens`` padded tokens each.

    Deterministic; every index appears exactly once; no micro-batch is empty. Within a micro-batch the
    indices are longest first.
    """
    if max_tokens < 1:
        raise ValueError(f"train.micro_batch_tokens must be >= 1, got {max_tokens}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"every sequence needs at least one token, got lengths {list(lengths)}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    # start from the fewest bins the sequences within the budget could fill; oversized ones open their own
    bins: list[list[int]] = [[] for _ in range(math.ceil(sum(n for n in lengths if n <= max_tokens) / max_tokens))]
    loads = [0] * len(bins)
    for i in order:
        # longest first, so a non-empty bin's longest sequence is its first and adding i keeps it so
        fits = [b for b, items in enumerate(bins) if not items or (len(items) + 1) * lengths[items[0]] <= max_tokens]
        if not fits or lengths[i] > max_tokens:
            bins.append([])
            loads.append(0)
            fits = [len(bins) - 1]
        target = min(fits, key=lambda b: (loads[b], b))
        bins[target].append(i)
        loads[target] += lengths[i]
    return [items for items in bins if items]


def equalize(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Grow ``bins`` to exactly ``count`` micro-batches: split the largest splittable ones, then add empty ones.

    A split halves a micro-batch by alternating its (longest-first) sequences, so both halves stay within
    the budget and balanced. Empty micro-batches are ``[]``.
    """
    if count < len(bins):
        raise ValueError(f"cannot shrink {len(bins)} micro-batches to {count}; count must be >= {len(bins)}")
    bins = [list(items) for items in bins]
    while len(bins) < count:
        splittable = [b for b, items in enumerate(bins) if len(items) >= 2]
        if not splittable:
            bins.extend([] for _ in range(count - len(bins)))
            break
        b = max(splittable, key=lambda b: (padded_tokens(bins[b], lengths), -b))
        items = bins[b]
        bins[b : b + 1] = [items[0::2], items[1::2]]
    return bins


def agree_count(local_count: int, group: dist.ProcessGroup | None) -> int:
    """The largest ``local_count`` over the ranks of ``group`` (a gloo group: the tensor stays on the CPU)."""
    if dist.get_world_size(group) == 1:
        return local_count
    value = torch.tensor([local_count], dtype=torch.long)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


def plan(lengths: Sequence[int], max_tokens: int, group: dist.ProcessGroup | None) -> list[list[int]]:
    """This rank's micro-batches, as many as on every other rank of ``group`` (some may be empty)."""
    bins = pack(lengths, max_tokens)
    return equalize(bins, lengths, agree_count(len(bins), group))
