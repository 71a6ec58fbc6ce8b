"""The rollout/trainer mismatch of a step's batch, where the controller holds both logprobs of every token.

The servers return the behaviour logprob of each sampled token (``old_logprobs``); decoupled PPO has the trainer
compute the same tokens' logprobs with its weights before the step's first update (``prox_logprobs``). Their
gap is what off-policy corrections act on: numerical (another kernel, another precision) when the servers sampled
with the trainer's current weights, and the policy's own change besides when the samples are stale (the
``staleness_*`` metrics beside them say how stale). ``off_policy.mismatch_metrics`` defines each number.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from hpcrl.rpc.messages import SequenceData
from hpcrl.train.algorithms.off_policy import mismatch_metrics


def batch_mismatch(sequences: list[SequenceData]) -> dict[str, float]:
    """``mismatch_*`` metrics over the loss tokens of ``sequences``; none unless every one has both logprobs."""
    if not sequences or any(s.prox_logprobs is None or s.old_logprobs is None for s in sequences):
        return {}

    def padded(rows: list[list[float]] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return pad_sequence([torch.tensor(r, dtype=dtype) for r in rows], batch_first=True)

    trainer = padded([s.prox_logprobs for s in sequences], torch.float64)
    behaviour = padded([s.old_logprobs for s in sequences], torch.float64)
    return mismatch_metrics(trainer, behaviour, padded([s.loss_mask for s in sequences], torch.bool))
