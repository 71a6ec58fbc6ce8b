"""Per-token loss terms over ``[batch, seq]`` tensors: the clipped surrogate, behaviour weights, KL penalty.

These functions know nothing of masks or aggregation: ``policy_loss`` (in ``__init__``) zeroes masked-out
positions before calling them and ``aggregate`` reduces their output. Everything except ``logprobs`` is a
constant of the update and is detached here, so a caller cannot leak gradient into it by accident.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's per-token loss ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``.

    ``ratio = exp(logprobs - old_logprobs)``; ``advantages`` is ``[batch]`` (one per sequence, broadcast over
    its tokens) or ``[batch, seq]``. Returns the loss and a BoolTensor of the tokens where the clipped term
    is the active one; those tokens get zero gradient.
    """
    advantages = advantages.detach()
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # where, not max: on ties torch.maximum splits the gradient between both branches
    is_clipped = clipped > unclipped
    return torch.where(is_clipped, clipped, unclipped), is_clipped


def behavior_weights(prox_logprobs: Tensor, behavior_logprobs: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Decoupled PPO (AReaL): importance weight ``exp(prox - behavior)`` of tokens sampled by an older policy.

    Follows AReaL's convention: a token whose weight exceeds ``cap`` is excluded (weight 0), not clipped to
    the cap, since a weight that large means the behaviour policy is too far from the proximal one for the
    sample to say anything about it. Returns the weights (0 where excluded) and the BoolTensor of kept tokens.
    """
    weight = torch.exp(prox_logprobs.detach() - behavior_logprobs.detach())
    kept = weight <= cap
    return torch.where(kept, weight, torch.zeros_like(weight)), kept


def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``log p - log p_ref``: unbiased for KL(p || p_ref) under samples of p, but single tokens may be < 0."""
    return logprobs - ref_logprobs.detach()


def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``(log p - log p_ref)^2 / 2``: biased as a value, but its gradient ``log(p / p_ref) * grad log p`` has the
    expected value of KL(p || p_ref)'s gradient over samples of p (the one estimator for a loss term)."""
    return 0.5 * (logprobs - ref_logprobs.detach()) ** 2


def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``exp(d) - d - 1`` with ``d = log p_ref - log p``: unbiased for KL(p || p_ref) and >= 0 on every token; as
    a loss its expected gradient is KL(p_ref || p)'s, so hpcrl only measures with it (the ``kl`` metric)."""
    d = ref_logprobs.detach() - logprobs
    return torch.exp(d) - d - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) by the estimator named (``KL_ESTIMATORS``)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator must be one of {sorted(KL_ESTIMATORS)}, got {estimator!r}")
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)


def reward_to_go(per_token: Tensor) -> Tensor:
    """``out[..., t] = sum of per_token[..., s] for s >= t``: a per-token reward's return (undiscounted)."""
    return per_token.flip(-1).cumsum(-1).flip(-1)
