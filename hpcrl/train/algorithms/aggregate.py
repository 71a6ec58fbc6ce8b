"""Reduce a per-token loss ``[batch, seq]`` to the scalar the optimizer steps on.

Modes (``algorithm.loss_agg``), each a numerator divided by a count of units:

- ``seq_mean_token_mean`` (GRPO): each sequence's mean over its masked tokens, then the mean over sequences.
  Unit: a sequence with at least one masked token.
- ``token_mean`` (DAPO): the sum over all masked tokens / the number of masked tokens. Unit: a masked token.
- ``seq_mean_token_sum_norm`` (Dr. GRPO): each sequence's masked token sum / ``max_tokens`` (a constant,
  e.g. ``rollout.max_new_tokens``, never the padded width), then the mean over sequences. Unit: as GRPO.

The mask is read as a boolean (non-zero = the token carries loss). A sequence with no masked token adds
nothing and is not counted, so padding rows change nothing; an all-masked batch gives 0, not NaN.

Micro-batches and ranks: split a global batch by whole sequences, compute ``loss_normalizer`` of every
piece, sum them (within the rank, then ``all_reduce`` across ranks) and pass that sum to ``aggregate`` as
``global_normalizer``. The pieces' losses then add up to the full batch's loss, so accumulated gradients
equal the full batch's gradient. FSDP/DDP *average* gradients over ranks, so multiply each rank's loss by
the world size (or turn the averaging off) to keep that equality across ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _token_sum(per_token: Tensor, mask: Tensor, max_tokens: float | None) -> Tensor:
    return per_token.sum()


def _seq_token_mean_sum(per_token: Tensor, mask: Tensor, max_tokens: float | None) -> Tensor:
    return (per_token.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum()


def _seq_token_sum_norm_sum(per_token: Tensor, mask: Tensor, max_tokens: float | None) -> Tensor:
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(
            f"loss_agg seq_mean_token_sum_norm needs max_tokens > 0 (pass rollout.max_new_tokens), got {max_tokens}"
        )
    return per_token.sum() / max_tokens


# mode -> (numerator over the batch, whether its unit is a sequence rather than a token)
_MODES: dict[str, tuple[Callable[[Tensor, Tensor, float | None], Tensor], bool]] = {
    "seq_mean_token_mean": (_seq_token_mean_sum, True),
    "token_mean": (_token_sum, False),
    "seq_mean_token_sum_norm": (_seq_token_sum_norm_sum, True),
}
AGGREGATIONS = tuple(_MODES)


def _mode(mode: str) -> tuple[Callable[[Tensor, Tensor, float | None], Tensor], bool]:
    if mode not in _MODES:
        raise ValueError(f"loss aggregation must be one of {list(_MODES)}, got {mode!r}")
    return _MODES[mode]


def loss_normalizer(mask: Tensor, mode: str) -> Tensor:
    """The count ``mode`` divides by in this batch: masked tokens, or sequences with a masked token."""
    per_seq = (mask != 0).sum(dim=-1)
    return (per_seq > 0).sum() if _mode(mode)[1] else per_seq.sum()


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    max_tokens: float | None = None,
    global_normalizer: Tensor | float | None = None,
) -> Tensor:
    """Scalar loss of ``per_token`` under ``mode``; divided by ``global_normalizer`` when given, else by this
    batch's own ``loss_normalizer``. A normaliser of 0 counts as 1 (the numerator is 0 then)."""
    numerator, _ = _mode(mode)
    keep = mask != 0
    total = numerator(torch.where(keep, per_token, torch.zeros_like(per_token)), keep, max_tokens)
    count = loss_normalizer(mask, mode) if global_normalizer is None else global_normalizer
    return total / torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp(min=1)
