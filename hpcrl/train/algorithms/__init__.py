"""RL objectives as small pure tensor functions, selected by ``AlgorithmConfig`` fields, never by name.

GRPO, Dr. GRPO, DAPO, REINFORCE++ and PPO differ only in the fields these two entry points read:

- ``compute_advantages(rewards, cfg)``: ``algorithm.advantage`` picks an estimator from ``ESTIMATORS`` (``gae``,
  which needs the critic's values, is the controller's ``apply_gae`` instead).
- ``policy_loss(...)``: the clipped surrogate (``clip_low``/``clip_high``), optionally against a proximal
  policy with capped behaviour weights (``behavior_weight_cap``) or an off-policy correction (``off_policy``),
  with a KL term to the reference policy (``kl.coef``) where ``kl.place`` puts it, reduced by ``loss_agg``.

For PPO with a learned critic (``algorithm.advantage=gae``), ``gae.py`` (GAE advantages and returns per token,
outcome-reward placement, batch whitening; called by the controller with the critic's values) and ``value.py``
(the clipped value loss the critic trains on, explained variance) hold the functions; ``policy_loss`` then gets
each token's own advantage.

The KL term (``hpcrl/config/checks.py`` holds the rule and its reference): ``kl.place=loss`` adds
``kl.coef * k2`` to each token's loss, whose expected gradient is that of each token's KL(pi || ref) at the
prefixes sampled; ``kl.place=reward`` subtracts ``kl.coef * k1`` of the behaviour policy per token from the
return, as PPO for RLHF does, so each token's advantage loses the KL of its own and every later token: the
policy gradient then carries the gradient of the whole sequence's KL, the way later tokens' KL depends on
earlier tokens included. The penalty is added to the task's advantage after that is normalised.

Logprob convention: every ``*logprobs`` tensor holds, per position, the log-probability of the token that
was sampled there under the *tempered* distribution ``log_softmax(logits / temperature)`` -- the same
quantity the inference server returns -- so trainer and server ratios compare like with like. Tensors
are ``[batch, seq]``; ``mask`` is 1 (True) on generated tokens that carry loss and 0 elsewhere.
Names of the policies:

- ``old_logprobs``: the behaviour policy, the one that sampled the tokens (as the server reported them, or as the
  trainer computed them before the step under ``algorithm.behaviour_logprobs=recompute``).
- ``prox_logprobs``: the proximal policy, the trainer's weights before this update (decoupled PPO only).
- ``ref_logprobs``: the frozen reference policy of the KL penalty.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import Tensor

from hpcrl.config.checks import kl_combination_problem
from hpcrl.config.schema import AlgorithmConfig
from hpcrl.train.algorithms.advantages import ESTIMATORS, equal_reward_groups
from hpcrl.train.algorithms.aggregate import AGGREGATIONS, aggregate, loss_normalizer
from hpcrl.train.algorithms.off_policy import correct
from hpcrl.train.algorithms.policy import (
    KL_ESTIMATORS,
    behavior_weights,
    clipped_surrogate,
    k3,
    kl_penalty,
    reward_to_go,
)

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "aggregate",
    "behavior_weights",
    "clipped_surrogate",
    "compute_advantages",
    "equal_reward_groups",
    "kl_penalty",
    "loss_normalizer",
    "needs_proximal",
    "policy_loss",
    "reward_to_go",
]


def _pick(options: Collection[str], name: str, field: str) -> None:
    if name not in options:
        raise ValueError(f"algorithm.{field} must be one of {sorted(options)}, got {name!r}; fix the config")


def needs_proximal(cfg: AlgorithmConfig) -> bool:
    """Whether the loss takes its ratio against ``prox_logprobs``: decoupled PPO, or any off-policy correction."""
    return cfg.behavior_weight_cap > 0 or cfg.off_policy.kind != "none"


def compute_advantages(rewards: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """Advantages ``[num_groups, group_size]`` of rewards of the same shape, by ``cfg.advantage``."""
    _pick(ESTIMATORS, cfg.advantage, "advantage")
    if rewards.dim() != 2 or rewards.shape[1] != cfg.group_size:
        raise ValueError(
            f"rewards must be [num_groups, algorithm.group_size={cfg.group_size}], got {tuple(rewards.shape)}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return ESTIMATORS[cfg.advantage](rewards, cfg.std_eps)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    *,
    ref_logprobs: Tensor | None = None,
    prox_logprobs: Tensor | None = None,
    max_tokens: float | None = None,
    global_normalizer: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss and metrics (token means over this batch's masked tokens).

    ``advantages`` is ``[batch]`` or ``[batch, seq]``. With ``cfg.behavior_weight_cap > 0`` the ratio is
    taken against ``prox_logprobs`` (required) and each token's loss is scaled by its behaviour weight, 0
    above the cap; such tokens still count in the normaliser (AReaL). With ``cfg.off_policy.kind`` set the ratio
    is against ``prox_logprobs`` too and the correction's weight (``off_policy.correct``) scales each token
    instead, the cap still excluding; the loss is reduced over the correction's ``loss_mask`` (MIS: without the
    tokens it rejects; metrics ``off_policy_weight_mean`` over the tokens kept, ``off_policy_excluded_frac`` and
    ``off_policy_truncated_frac`` of the loss tokens). Otherwise ``prox_logprobs`` is ignored.
    ``ref_logprobs`` is required when ``cfg.kl.coef > 0``; the KL term goes where ``cfg.kl.place`` says (module
    docstring); the ``kl`` metric is the k3 estimate of KL(policy || reference), whatever the term's estimator.
    ``max_tokens`` and ``global_normalizer``: see ``aggregate``.
    """
    _pick(AGGREGATIONS, cfg.loss_agg, "loss_agg")
    kl_cfg = cfg.kl
    _pick(KL_ESTIMATORS, kl_cfg.estimator, "kl.estimator")
    if problem := kl_combination_problem(kl_cfg.place, kl_cfg.estimator):
        raise ValueError(f"algorithm.kl.estimator={kl_cfg.estimator!r} is invalid: expected {problem}")
    if kl_cfg.coef > 0 and ref_logprobs is None:
        raise ValueError("algorithm.kl.coef > 0 needs ref_logprobs (the reference policy's logprobs)")
    keep = mask != 0
    # zero the masked-out positions first: padding may hold inf/NaN logprobs, whose gradient would
    # poison the real tokens' (0 * inf = NaN) even if the loss there were masked afterwards
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    logprobs, old_logprobs, advantages = (t.masked_fill(~keep, 0.0) for t in (logprobs, old_logprobs, advantages))
    ref = None if ref_logprobs is None else ref_logprobs.masked_fill(~keep, 0.0)
    if ref is not None and kl_cfg.coef > 0 and kl_cfg.place == "reward":
        penalty = kl_penalty(old_logprobs.detach(), ref, kl_cfg.estimator).masked_fill(~keep, 0.0)
        advantages = advantages - kl_cfg.coef * reward_to_go(penalty)

    anchor, weight, kept, loss_keep, correction = old_logprobs, None, keep, keep, None
    if needs_proximal(cfg):
        if prox_logprobs is None:
            raise ValueError(
                "algorithm.behavior_weight_cap > 0 and algorithm.off_policy.kind need prox_logprobs (the policy "
                "before this update)"
            )
        anchor = prox_logprobs.masked_fill(~keep, 0.0)
    if cfg.off_policy.kind != "none":
        correction = correct(anchor, old_logprobs, keep, cfg.off_policy)
        weight, kept, loss_keep = correction.weight, correction.kept, correction.loss_mask
    if cfg.behavior_weight_cap > 0:
        behavior, within = behavior_weights(anchor, old_logprobs, cfg.behavior_weight_cap)
        # with a correction, its weight replaces the behaviour weight (the same ratio, weighed once) and the cap
        # still excludes what it excludes; a token so excluded stays in the normaliser, as in AReaL
        weight = behavior if weight is None else torch.where(within, weight, 0.0)
        kept = kept & within
    per_token, clipped = clipped_surrogate(logprobs, anchor, advantages, cfg.clip_low, cfg.clip_high)
    if weight is not None:
        per_token = per_token * weight

    stats: dict[str, Tensor] = {}
    if ref is not None:
        stats["kl"] = _token_mean(k3(logprobs.detach(), ref), keep)
        if kl_cfg.coef > 0 and kl_cfg.place == "loss":
            per_token = per_token + kl_cfg.coef * kl_penalty(logprobs, ref, kl_cfg.estimator)

    loss = aggregate(per_token, loss_keep, cfg.loss_agg, max_tokens, global_normalizer)
    stats["clip_frac"] = _token_mean(clipped.to(per_token.dtype), keep)
    stats["ratio_mean"] = _token_mean(torch.exp(logprobs.detach() - anchor), keep)
    if correction is not None:
        tokens = keep.sum().clamp(min=1).to(per_token.dtype)  # long / long would be float32
        # a token the behaviour cap excluded is not also one TIS truncated: count the truncated among the kept
        truncated = (kept & (anchor - old_logprobs.detach() > math.log(cfg.off_policy.cap))).sum()
        stats["off_policy_weight_mean"] = _token_mean(weight, kept)
        stats["off_policy_excluded_frac"] = (keep & ~kept).sum() / tokens
        stats["off_policy_truncated_frac"] = truncated / tokens if cfg.off_policy.kind == "tis" else 0.0 * tokens
    elif weight is not None:
        stats["behavior_weight_mean"] = _token_mean(weight, kept)
        stats["behavior_excluded_frac"] = 1.0 - _token_mean(kept.to(per_token.dtype), keep)
    return loss, dict(zip(stats, torch.stack(list(stats.values())).tolist(), strict=True))  # one device sync


def _token_mean(values: Tensor, keep: Tensor) -> Tensor:
    return torch.where(keep, values, torch.zeros_like(values)).sum() / keep.sum().clamp(min=1)
