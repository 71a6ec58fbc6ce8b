"""The engines' loss functions, built from the algorithm config: the actor's ``policy_loss`` and the critic's
``value_loss``, each with global normalisers."""

from __future__ import annotations

import math

from torch import Tensor

from hpcrl.config.schema import AlgorithmConfig
from hpcrl.train.algorithms import policy_loss
from hpcrl.train.algorithms.off_policy import SEQUENCE_MISMATCH, mismatch_metrics
from hpcrl.train.algorithms.value import value_loss
from hpcrl.train.batch import MicroBatch, Normalizer


def _denominator(cfg: AlgorithmConfig, normalizer: Normalizer) -> int:
    return normalizer.tokens if cfg.loss_agg == "token_mean" else normalizer.sequences


def make_loss_fn(cfg: AlgorithmConfig, max_new_tokens: int):
    """``loss_fn(logprobs, microbatch, normalizer)`` for ``Engine.train_step``.

    Each micro-batch's loss is its partial sum divided by the GLOBAL count (loss tokens for token-level
    aggregation, sequences otherwise), so the micro-batch losses of every rank add up to the loss of the
    whole batch. Dr. GRPO's constant divisor is ``rollout.max_new_tokens``. Per-token advantages (GAE) are
    used where the batch has them, else each sequence's one advantage. The rollout/trainer mismatch
    (``step_mismatch``) is measured against the servers' logprobs only: with ``behaviour_logprobs=recompute``
    the behaviour logprobs are this trainer's own, so there is no gap to measure and no ``mismatch_*`` metric.
    """
    measure = cfg.behaviour_logprobs == "server"

    def loss_fn(logprobs: Tensor, mb: MicroBatch, normalizer: Normalizer):
        if mb.old_logprobs is None:  # the current policy in their place would make every ratio 1: nothing clipped
            raise ValueError("the policy loss needs the behaviour logprobs (old_logprobs) of every sequence")
        loss, metrics = policy_loss(
            logprobs,
            mb.old_logprobs,
            mb.token_advantages if mb.token_advantages is not None else mb.advantages,
            mb.loss_mask,
            cfg,
            ref_logprobs=mb.ref_logprobs,
            prox_logprobs=mb.prox_logprobs,
            max_tokens=max_new_tokens,
            global_normalizer=_denominator(cfg, normalizer),
        )
        return loss, ({**metrics, **step_mismatch(logprobs, mb, normalizer)} if measure else metrics)

    return loss_fn


def step_mismatch(logprobs: Tensor, mb: MicroBatch, normalizer: Normalizer) -> dict[str, float]:
    """``off_policy.mismatch_metrics`` of this micro-batch's forward against its behaviour logprobs, in the form the
    engine reduces to the global batch's: it averages a metric over micro-batches and ranks weighted by their loss
    tokens (exact for token means) and takes the max of a ``*_max`` one; a per-sequence mean is rescaled here so
    that this weighted average is the global per-sequence mean. Before an update the forward is the trainer's
    policy as it stands, so the first update of a step measures the rollout/trainer gap (the controller keeps it)."""
    stats = mismatch_metrics(logprobs, mb.old_logprobs, mb.loss_mask)
    keep = mb.loss_mask != 0
    tokens, sequences = int(keep.sum()), int(keep.any(dim=-1).sum())
    if tokens and normalizer.sequences:
        scale = sequences / tokens * normalizer.tokens / normalizer.sequences
        for name in SEQUENCE_MISMATCH:
            stats[name] *= scale
    return stats


def make_value_loss_fn(cfg: AlgorithmConfig, max_new_tokens: int):
    """``loss_fn(values, microbatch, normalizer)`` for the critic's ``Engine.train_step``: the clipped value
    loss against the batch's GAE ``returns``, around its ``old_values`` (``algorithm.value_clip``, 0 = none),
    reduced like the actor's loss. Metric: ``clip_frac``, the share of tokens whose clipped term is the active one."""
    clip = cfg.value_clip if cfg.value_clip > 0 else math.inf

    def loss_fn(values: Tensor, mb: MicroBatch, normalizer: Normalizer):
        if mb.returns is None or mb.old_values is None:
            raise ValueError("a critic's train step needs returns and old_values on every sequence (from GAE)")
        loss, clip_frac = value_loss(
            values,
            mb.old_values,
            mb.returns,
            mb.loss_mask,
            clip,
            cfg.loss_agg,
            max_new_tokens,
            _denominator(cfg, normalizer),
        )
        return loss, {"clip_frac": clip_frac}

    return loss_fn
