"""The critic's objective and its main diagnostic: the clipped value loss and explained variance.

The critic's ranks train on this loss (``hpcrl/train/loss.py``'s ``make_value_loss_fn``, clip
``algorithm.value_clip``); the controller reports explained variance each step (``critic_explained_var``).

Tensors are ``[batch, seq]`` with a ``mask`` non-zero on the tokens that carry loss, as in ``gae.py``.
``values`` are the critic's predictions now (with gradient); ``old_values`` are its predictions when the
batch's advantages were computed and ``returns`` the GAE returns of that moment, both constants here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hpcrl.train.algorithms.aggregate import aggregate


def clipped_value_error(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """Per token ``0.5 * max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2)`` and where the clipped
    term is the larger one (PPO's value clipping, as in verl, OpenRLHF and TRL).

    The clipped term is only larger when ``v`` has left ``v_old +- clip`` on the side away from ``R``; ``v``
    is then constant in that term, so those tokens get zero gradient: one update cannot move a value further
    than ``clip`` from where it was by chasing its target past it. ``clip=math.inf`` turns clipping off.
    """
    if not clip > 0:
        raise ValueError(f"value clip must be > 0 (math.inf turns clipping off), got {clip}")
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns).square()
    clipped = (torch.clamp(values, old_values - clip, old_values + clip) - returns).square()
    # where, not max: the branch used is then exactly the one is_clipped (the clip fraction) reports
    is_clipped = clipped > unclipped
    return 0.5 * torch.where(is_clipped, clipped, unclipped), is_clipped


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float,
    loss_agg: str = "token_mean",
    max_tokens: float | None = None,
    global_normalizer: Tensor | float | None = None,
) -> tuple[Tensor, Tensor]:
    """Scalar clipped value loss, reduced like the actor's loss (``aggregate``), and the clip fraction.

    ``loss_agg``, ``max_tokens`` and ``global_normalizer`` mean what they mean for ``aggregate``. The clip
    fraction is the share of masked tokens where the clipped term is the active one (a detached 0-dim
    tensor, so the caller decides when to sync). Masked positions contribute nothing, not even NaN.
    """
    keep = mask != 0
    # zero the masked-out positions first: padding may hold NaN values, whose gradient would poison
    # the real tokens' (0 * NaN = NaN) even if the loss there were masked afterwards
    values, old_values, returns = (t.masked_fill(~keep, 0.0) for t in (values, old_values, returns))
    per_token, is_clipped = clipped_value_error(values, old_values, returns, clip)
    loss = aggregate(per_token, keep, loss_agg, max_tokens, global_normalizer)
    fraction = (is_clipped & keep).to(per_token.dtype).sum() / keep.sum().clamp(min=1)
    return loss, fraction.detach()


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the masked tokens of the batch (population variances).

    1 for perfect values, 0 for values that only know the mean return, below 0 for values worse than that.
    NaN when it is undefined: no masked token, or every return equal (then no value explains anything).
    """
    keep = mask != 0
    count = keep.sum()
    # max == min, not variance == 0: equal returns such as 0.1 leave a rounding residue in the variance
    if count == 0 or returns.masked_fill(~keep, -torch.inf).amax() == returns.masked_fill(~keep, torch.inf).amin():
        return math.nan
    returns, error = returns.masked_fill(~keep, 0.0), (returns - values).masked_fill(~keep, 0.0)

    def variance(x: Tensor) -> Tensor:
        centered = (x - x.sum() / count).masked_fill(~keep, 0.0)
        return centered.square().sum() / count

    return float(1.0 - variance(error) / variance(returns))
