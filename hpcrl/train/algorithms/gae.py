"""GAE for PPO with a learned critic: per-token advantages and returns, and batch whitening.

``algorithm.advantage=gae`` (``algorithm=ppo``): the controller calls these on each batch with the critic's
values (``hpcrl/controller/batch.py``'s ``apply_gae``), with ``algorithm.gamma`` and ``algorithm.lam``.

Layout: every tensor is ``[batch, seq]``, right-padded, aligned like a ``MicroBatch``'s per-token tensors
(column ``t`` is about the token the sequence predicts there); ``mask`` is non-zero on the response tokens
that carry loss, i.e. the agent's actions. Prompt tokens, tool outputs between turns and padding have
mask 0.

Masked positions are skipped, not treated as steps: the recursion carries the next action's value and the
running advantage across them, so an episode whose turns are separated by tool output gets exactly the
advantages it would get with the tool tokens cut out (verl's handling of observation tokens; right padding
is the special case with nothing after it). Advantages and returns are exactly 0 there. A reward must sit on
a masked-in token -- ``outcome_token_rewards`` puts a sequence's reward on its last response token -- and
``gae_advantages`` refuses one elsewhere rather than drop it.

Whitening uses the population std, like ``advantages.py`` and for the same reasons (verl's ``masked_whiten``
uses the unbiased one). Whiten the advantages, never the returns: the returns are the critic's targets.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or any(len(shape) != 2 for shape in shapes.values()):
        raise ValueError(f"expected [batch, seq] tensors of one shape, got {shapes}")


def last_token_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, the column of the last non-zero ``mask`` entry (0 if none) and whether the row has one."""
    keep = mask != 0
    width = keep.shape[-1]
    index = width - 1 - keep.flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.where(keep.any(dim=-1), index, torch.zeros_like(index)), keep.any(dim=-1)


def outcome_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """``[batch, seq]`` rewards: each row's ``scores[row]`` on its last response token, 0 elsewhere.

    A row without a response token gets no reward: it carries no loss either, so nothing trains on it.
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [batch={mask.shape[0]}], got {tuple(scores.shape)}")
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    index, has_token = last_token_index(mask)
    rewards.scatter_(-1, index.unsqueeze(-1), torch.where(has_token, scores.to(dtype), 0).unsqueeze(-1))
    return rewards


@torch.no_grad()
def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimates and returns, each ``[batch, seq]``, 0 at masked positions.

    Over a row's response tokens ``t_0 < t_1 < ... < t_n`` (masked positions skipped):
    ``delta_i = r(t_i) + gamma * V(t_{i+1}) - V(t_i)`` with ``V(t_{n+1}) = 0`` (the episode ends after its last
    response token), ``A(t_i) = delta_i + gamma * lam * A(t_{i+1})``, and the return ``A + V`` is the
    lambda-return the critic regresses on. Outputs are constants of the update (no gradient flows back).
    """
    _check_same_shape(rewards=rewards, values=values, mask=mask)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"GAE's {name} must be in [0, 1], got {value}")
    keep = mask != 0
    if (rewards.masked_fill(keep, 0) != 0).any():
        raise ValueError(
            "rewards are non-zero at positions where mask is 0 (prompt, tool output or padding), which GAE skips; "
            "put each reward on a response token (outcome_token_rewards puts it on the last one)"
        )
    # zeroed, so NaN or inf in padding cannot reach the real tokens through the carried terms
    values = values.masked_fill(~keep, 0.0)
    rewards = rewards.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    running = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[-1])):
        step = keep[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(step, delta + gamma * lam * running, running)
        next_value = torch.where(step, values[:, t], next_value)
        advantages[:, t] = torch.where(step, running, 0.0)
    return advantages, (advantages + values).masked_fill(~keep, 0.0)


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-6, shift_mean: bool = True) -> Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries of the whole batch; 0 at masked positions.

    ``shift_mean=True`` (advantages) leaves mean 0; ``False`` adds the mean back, so only the spread is
    rescaled (whitening rewards while keeping their sign). The std is the population std. Entries that
    are all equal give exactly 0 (or the mean), not the rounding residue divided by ``eps``.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x and mask must have one shape, got {tuple(x.shape)} and {tuple(mask.shape)}")
    keep = mask != 0
    count = keep.sum().clamp(min=1)
    mean = x.masked_fill(~keep, 0.0).sum() / count
    centered = (x - mean).masked_fill(~keep, 0.0)
    std = (centered.square().sum() / count).sqrt()
    # max == min over the masked entries, without boolean indexing (a device sync)
    constant = x.masked_fill(~keep, -torch.inf).amax() == x.masked_fill(~keep, torch.inf).amin()
    scaled = torch.where(constant, torch.zeros_like(centered), centered / (std + eps))
    if not shift_mean:
        scaled = scaled + mean
    return scaled.masked_fill(~keep, 0.0)
