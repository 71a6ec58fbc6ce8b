"""Off-policy corrections and mismatch metrics between the policy that sampled the tokens and the trainer's.

``algorithm.off_policy.kind`` picks the correction ``policy_loss`` applies (``correct``). Two logprobs of the
same sampled tokens, ``[batch, seq]`` with ``mask`` 1 on the loss tokens (names as in the package docstring):

- behaviour (``old_logprobs``): what the server reported when it sampled them;
- trainer (``prox_logprobs``): the trainer's logprobs before this step's update. Their ratio
  ``rho = exp(trainer - behaviour)`` holds the numerical mismatch of the two stacks and, under asynchronous
  rollout, the staleness of the sampling weights.

Every function reads the mask as a boolean and never lets a masked-out position (padding may hold inf/NaN)
reach a weight, a count or a metric. Weights are detached: they scale the per-token loss, they are not trained.

``mismatch_metrics`` measures the gap. The corrections each return a ``Correction``:

- ``tis``, truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): every token keeps its loss, weighted by ``min(rho, cap)``. The truncation trades a
  little bias for bounded variance. Use it when the mismatch is small and steady (same weights, two numerical
  stacks): no token is thrown away.
- ``mis_token`` / ``mis_sequence``, masked importance sampling as verl's rollout correction defines it
  (volcengine/verl ``verl/trainer/ppo/rollout_corr_helper.py``: ``rollout_rs`` ``token`` and ``sequence``, whose
  acceptance sets ``low <= rho_t <= high`` and ``low <= prod_t rho_t <= high`` are written in
  ``docs/algo/rollout_corr_math.md`` section 3.5; the Seq-MIS preset ``decoupled_seq_is_rs`` pairs the sequence
  mask with the sequence's importance weight): a token (a whole sequence) whose ratio leaves the band is masked
  out of the loss, normaliser included, as verl removes it from ``response_mask``; a kept one is weighted by its
  ratio (the sequence's product, broadcast). Use it when a ratio far from 1 means a broken sample rather than
  signal (large staleness, MoE routing flips); the sequence level is unbiased per sequence but rejects long
  sequences more often, since their products drift further (verl's length-invariant geometric mean,
  ``rollout_rs=geometric`` / ``seq_mean_k1``, is not built here).
- ``icepop`` (Ling team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
  the Ring-1T report): double-sided masking, ``M(rho) = rho`` inside ``[alpha, beta]`` and 0 outside. Its
  objective divides each sequence's sum by all of its tokens, ``1 / |y_i|``, so a masked token still counts in
  the normaliser: the one difference from ``mis_token``. Use it as MIS at the token level when rejected tokens
  should shrink the update rather than be averaged away.

Composition with decoupled PPO (``behavior_weights`` in ``policy.py``): every correction weighs the same ratio as
decoupled PPO's behaviour weight, ``prox / behaviour``, and decoupled PPO's exclusion above ``behavior_weight_cap``
*is* ``icepop(prox, behaviour, mask, 0, cap)`` (a test checks it). So with a correction on, the clipped surrogate's
ratio is taken against ``prox_logprobs`` (decoupled PPO's anchor; Yao et al.'s ``pi_fsdp(theta_old)``; IcePop's
``pi_train(theta_old)``), and the correction's weight *replaces* the behaviour weight: multiplying both would apply
the importance ratio twice. With ``behavior_weight_cap > 0`` as well, the cap still excludes the tokens above it
(weight 0, kept in the normaliser). The per-token loss is ``correction.weight * clipped_surrogate(logprobs, prox,
A)``, reduced by ``aggregate`` over ``correction.loss_mask``. For MIS that mask is also what the normaliser
counts: on the trainers, whose normaliser is counted over the global batch before the loss runs, the controller
has already taken the rejected tokens out of the batch's loss mask (``controller/mismatch.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hpcrl.config.schema import OffPolicyConfig
from hpcrl.train.algorithms.policy import k3

# mismatch_metrics counts a token as out of band when its ratio leaves [1/2, 2]
OUT_BAND = 2.0
# mismatch_metrics' means over sequences (the others are over tokens, and the max)
SEQUENCE_MISMATCH = ("mismatch_seq_out_frac", "mismatch_seq_log_ratio")


@dataclass(frozen=True)
class Correction:
    """One correction's per-token weight, the tokens it keeps and its counts (0-dim tensors: no device sync).

    ``weight`` is detached and 0 off the mask and on every token the correction excludes. ``kept`` is True on the
    loss tokens it keeps. ``loss_mask`` is what the loss is reduced over (``aggregate``'s mask and the count of
    its normaliser): ``kept`` for MIS, the input mask for TIS and IcePop. ``excluded`` counts loss tokens whose
    weight the correction set to 0; ``truncated`` counts those whose weight TIS lowered to its cap.
    """

    weight: Tensor
    kept: Tensor
    loss_mask: Tensor
    excluded: Tensor
    truncated: Tensor


def mismatch_metrics(trainer_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """The gap between the trainer's and the behaviour logprobs of the tokens under ``mask``, as floats.

    With ``d = trainer - behaviour`` per token and ``rho = exp(d)``:

    - ``mismatch_abs_mean``, ``mismatch_abs_max``: mean and max of ``|d|`` over the loss tokens;
    - ``mismatch_kl_k3``: token mean of ``rho - 1 - d``; the tokens were sampled from the behaviour policy, and
      there ``E[rho] = 1``, so this is an unbiased, never negative estimate of KL(behaviour || trainer);
    - ``mismatch_out_frac``: share of loss tokens whose ``rho`` leaves ``[1/2, 2]``;
    - ``mismatch_seq_out_frac``: share of sequences (those with a loss token) holding such a token;
    - ``mismatch_seq_log_ratio``: mean over those sequences of their summed ``d``, the log of the sequence ratio.

    An empty mask gives 0 for each.
    """
    keep, d = _masked_log_ratio(trainer_logprobs, behaviour_logprobs, mask)
    zero = torch.zeros_like(d)
    tokens = keep.sum().clamp(min=1).to(d.dtype)  # long / long would be float32, not d's dtype
    has_tokens = keep.any(dim=-1)
    sequences = has_tokens.sum().clamp(min=1).to(d.dtype)
    out = keep & (d.abs() > math.log(OUT_BAND))
    # k3(p, ref) estimates KL(p || ref) under samples of p; both shifted by the behaviour logprob, p is the
    # behaviour policy at 0 and ref the trainer at d (off the mask d = 0, and k3 is exactly 0 there)
    kl = k3(zero, d)
    stats = {
        "mismatch_abs_mean": d.abs().sum() / tokens,
        "mismatch_abs_max": d.abs().max() if d.numel() else d.new_zeros(()),
        "mismatch_kl_k3": kl.sum() / tokens,
        "mismatch_out_frac": out.sum() / tokens,
        "mismatch_seq_out_frac": out.any(dim=-1).sum() / sequences,
        "mismatch_seq_log_ratio": d.sum() / sequences,
    }
    return dict(zip(stats, torch.stack(list(stats.values())).tolist(), strict=True))


def tis(trainer_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float) -> Correction:
    """Truncated importance sampling: weight ``min(rho, cap)`` on every loss token; none is excluded."""
    if not cap > 0:
        raise ValueError(f"tis: cap must be > 0 (the largest importance weight), got {cap}")
    keep, d = _masked_log_ratio(trainer_logprobs, behaviour_logprobs, mask)
    log_cap = math.log(cap)
    weight = torch.where(keep, torch.exp(d.clamp(max=log_cap)), torch.zeros_like(d))
    return Correction(weight, keep, keep, _none(keep), (keep & (d > log_cap)).sum())


def mis_token(
    trainer_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, low: float, high: float
) -> Correction:
    """Token-level masked importance sampling: weight ``rho`` where ``low <= rho <= high``, else the token is
    masked out of the loss and of its normaliser (``loss_mask``)."""
    _check_band(low, high, "mis_token", "low", "high")
    keep, d = _masked_log_ratio(trainer_logprobs, behaviour_logprobs, mask)
    kept = keep & _in_band(d, low, high)
    return _masked_ratio(d, keep, kept, loss_mask=kept)


def mis_sequence(
    trainer_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, low: float, high: float
) -> Correction:
    """Sequence-level masked importance sampling: a sequence's ratio is the product of its loss tokens' ratios
    (verl's ``sequence`` level, not the geometric mean); inside ``[low, high]`` every loss token of the sequence
    is weighted by it, outside all of them are masked out of the loss and of its normaliser together."""
    _check_band(low, high, "mis_sequence", "low", "high")
    keep, d = _masked_log_ratio(trainer_logprobs, behaviour_logprobs, mask)
    seq = d.sum(dim=-1, keepdim=True).expand_as(d)
    kept = keep & _in_band(seq, low, high)
    return _masked_ratio(seq, keep, kept, loss_mask=kept)


def icepop(trainer_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, alpha: float, beta: float) -> Correction:
    """IcePop: weight ``rho`` where ``alpha <= rho <= beta``, else 0; a zeroed token stays in the normaliser."""
    _check_band(alpha, beta, "icepop", "alpha", "beta")
    keep, d = _masked_log_ratio(trainer_logprobs, behaviour_logprobs, mask)
    return _masked_ratio(d, keep, keep & _in_band(d, alpha, beta), loss_mask=keep)


def correct(trainer_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: OffPolicyConfig) -> Correction:
    """The correction ``cfg.kind`` names (not ``none``), with its cap (``tis``) or band (the others)."""
    if cfg.kind == "tis":
        return tis(trainer_logprobs, behaviour_logprobs, mask, cfg.cap)
    if cfg.kind not in _BANDED:
        raise ValueError(f"algorithm.off_policy.kind must be one of tis, {', '.join(_BANDED)}, got {cfg.kind!r}")
    return _BANDED[cfg.kind](trainer_logprobs, behaviour_logprobs, mask, cfg.low, cfg.high)


_BANDED = {"mis_token": mis_token, "mis_sequence": mis_sequence, "icepop": icepop}
# the corrections that take tokens out of the loss and its normaliser: the controller removes them from the
# batch's loss mask before the step, so that the trainers' global normaliser counts only the kept tokens
MASKING = ("mis_token", "mis_sequence")


def _masked_log_ratio(trainer: Tensor, behaviour: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The loss-token mask as booleans and ``trainer - behaviour`` there (0 elsewhere), detached, >= float32."""
    if not trainer.shape == behaviour.shape == mask.shape:
        raise ValueError(
            "trainer_logprobs, behaviour_logprobs and mask must have one shape [batch, seq], got "
            f"{tuple(trainer.shape)}, {tuple(behaviour.shape)} and {tuple(mask.shape)}"
        )
    keep = mask != 0
    dtype = torch.promote_types(trainer.dtype, torch.float32)
    d = trainer.detach().to(dtype) - behaviour.detach().to(dtype)
    return keep, torch.where(keep, d, torch.zeros_like(d))  # where, not *: 0 * inf is NaN


def _check_band(low: float, high: float, fn: str, low_name: str, high_name: str) -> None:
    # a band without ratio 1 would drop the tokens on which both policies agree
    if not 0 <= low <= 1 <= high or not low < high:
        raise ValueError(
            f"{fn}: the band needs 0 <= {low_name} <= 1 <= {high_name} and {low_name} < {high_name}, "
            f"got {low_name}={low}, {high_name}={high}"
        )


def _in_band(log_ratio: Tensor, low: float, high: float) -> Tensor:
    # compared in log space: exp(log 2) may round past 2, and a huge log ratio would overflow exp
    log_low = -math.inf if low == 0 else math.log(low)
    return (log_ratio >= log_low) & (log_ratio <= math.log(high))


def _masked_ratio(log_ratio: Tensor, keep: Tensor, kept: Tensor, loss_mask: Tensor) -> Correction:
    weight = torch.where(kept, torch.exp(log_ratio), 0.0)  # an out-of-band exp may overflow: never selected
    return Correction(weight, kept, loss_mask, (keep & ~kept).sum(), _none(keep))


def _none(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=torch.long, device=like.device)
