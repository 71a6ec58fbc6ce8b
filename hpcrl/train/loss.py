"""The engine's loss function, built from the algorithm config: ``policy_loss`` with global normalisers."""

from __future__ import annotations

from torch import Tensor

from hpcrl.config.schema import AlgorithmConfig
from hpcrl.train.algorithms import policy_loss
from hpcrl.train.batch import MicroBatch, Normalizer


def make_loss_fn(cfg: AlgorithmConfig, max_new_tokens: int):
    """``loss_fn(logprobs, microbatch, normalizer)`` for ``Engine.train_step``.

    Each micro-batch's loss is its partial sum divided by the GLOBAL count (loss tokens for token-level
    aggregation, sequences otherwise), so the micro-batch losses of every rank add up to the loss of the
    whole batch. Dr. GRPO's constant divisor is ``rollout.max_new_tokens``.
    """

    def loss_fn(logprobs: Tensor, mb: MicroBatch, normalizer: Normalizer):
        denominator = normalizer.tokens if cfg.loss_agg == "token_mean" else normalizer.sequences
        return policy_loss(
            logprobs,
            mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach(),
            mb.advantages,
            mb.loss_mask,
            cfg,
            ref_logprobs=mb.ref_logprobs,
            prox_logprobs=mb.prox_logprobs,
            max_tokens=max_new_tokens,
            global_normalizer=denominator,
        )

    return loss_fn
