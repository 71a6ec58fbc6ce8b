"""Advantage estimators: rewards ``[num_groups, group_size]`` in, one advantage per sample out (same shape).

Every estimator has the signature ``fn(rewards, eps) -> advantages`` so the trainer picks one from
``ESTIMATORS`` by ``algorithm.advantage``; ``group_center`` takes ``eps`` and ignores it.

Std convention: the population std (``unbiased=False``, divide by n), for two reasons. The normalised
advantages then have exactly unit root-mean-square in every group, whatever the group size, which is what
"normalised" promises; and a group (or batch) of one sample has std 0 rather than NaN. Implementations that
use the unbiased std (TRL, verl) get advantages smaller by sqrt((n - 1) / n), e.g. 0.935x at n = 8; the
clipped objective is not scale invariant, so the two are close but not identical.

A group whose rewards are all equal gets advantages of exactly 0 (not the rounding residue of
``r - mean(r)`` divided by ``eps``): such groups carry no learning signal, and DAPO drops them
(``equal_reward_groups``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def equal_reward_groups(rewards: Tensor) -> Tensor:
    """BoolTensor ``[num_groups]``: True where every reward of the group is equal (DAPO dynamic sampling)."""
    return (rewards == rewards[..., :1]).all(dim=-1)


def _center(rewards: Tensor) -> Tensor:
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    return torch.where(equal_reward_groups(rewards)[..., None], torch.zeros_like(centered), centered)


def group_norm(rewards: Tensor, eps: float) -> Tensor:
    """GRPO: ``(r - group mean) / (group population std + eps)``."""
    return _center(rewards) / (rewards.std(dim=-1, correction=0, keepdim=True) + eps)


def group_center(rewards: Tensor, eps: float = 0.0) -> Tensor:
    """Dr. GRPO: ``r - group mean``, no std division (no per-question difficulty weighting)."""
    return _center(rewards)


def batch_norm(rewards: Tensor, eps: float) -> Tensor:
    """PPO without a critic: ``(r - batch mean) / (batch population std + eps)`` over all rewards at once."""
    flat = rewards.reshape(1, -1)
    return (_center(flat) / (flat.std(correction=0) + eps)).reshape(rewards.shape)


ESTIMATORS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "group_norm": group_norm,
    "group_center": group_center,
    "batch_norm": batch_norm,
}
