"""The rollout/trainer mismatch of a step's batch, and the masking corrections, where the controller holds both
logprobs of every token.

The servers return the behaviour logprob of each sampled token (``old_logprobs``); with decoupled PPO or an
off-policy correction the trainers compute the same tokens' logprobs with their weights before the step's first
update (``prox_logprobs``). Their gap is what off-policy corrections act on: numerical (another kernel, another
precision) when the servers sampled with the trainer's current weights, and the policy's own change besides when
the samples are stale (the ``staleness_*`` metrics beside them say how stale). ``off_policy.mismatch_metrics``
defines each number. Without those logprobs, the trainers measure the gap in the step's first update instead
(``train/loss.py``'s ``step_mismatch``), and ``first_update_mismatch`` keeps that update's numbers. With
``algorithm.behaviour_logprobs=recompute`` the servers are asked for no logprobs, so there is nothing to measure
against: no ``mismatch_*`` metric at all (``log_unmeasured`` says so once, in the controller's log).
"""

from __future__ import annotations

import logging

import torch
from torch.nn.utils.rnn import pad_sequence

from hpcrl.config.schema import AlgorithmConfig, OffPolicyConfig
from hpcrl.rpc.messages import SequenceData
from hpcrl.train.algorithms.off_policy import MASKING, correct, mismatch_metrics

PREFIX = "mismatch_"

log = logging.getLogger(__name__)


def log_unmeasured(cfg: AlgorithmConfig) -> None:
    """One line in the log, when the run has no server logprobs to measure the mismatch with."""
    if cfg.behaviour_logprobs == "recompute":
        log.info(
            "algorithm.behaviour_logprobs=recompute: the servers are asked for no logprobs and the trainers' own "
            "are the behaviour logprobs, so the rollout/trainer mismatch is not measured (no mismatch_* metrics)"
        )


def batch_mismatch(sequences: list[SequenceData], trainer: list[list[float]]) -> dict[str, float]:
    """``mismatch_*`` metrics over the loss tokens of ``sequences`` between ``trainer`` (each sequence's trainer
    logprobs) and their behaviour logprobs; none unless every sequence has both."""
    if not sequences or any(s.old_logprobs is None for s in sequences) or len(trainer) != len(sequences):
        return {}
    behaviour = _padded([s.old_logprobs for s in sequences], torch.float64)
    return mismatch_metrics(_padded(trainer, torch.float64), behaviour, _loss_masks(sequences))


def mask_rejected(sequences: list[SequenceData], cfg: OffPolicyConfig) -> dict[str, float]:
    """Masked importance sampling (``mis_token``, ``mis_sequence``): the tokens the correction rejects leave each
    sequence's ``loss_mask``, so that the trainers' normaliser, counted over the global batch before the loss
    runs, counts only the kept ones. Computed in float32 as the trainers compute it (the logprobs travel as
    float32), so a token's decision is theirs; a sequence's summed ratio may differ from theirs in its last bit.
    Returns ``off_policy_masked_frac``, the share of loss tokens removed; nothing for the other corrections."""
    if cfg.kind not in MASKING or not sequences:
        return {}
    mask = _loss_masks(sequences)
    trainer = _padded([s.prox_logprobs for s in sequences], torch.float32)
    kept = correct(trainer, _padded([s.old_logprobs for s in sequences], torch.float32), mask, cfg).kept
    for seq, row in zip(sequences, kept, strict=True):
        seq.loss_mask = [int(k) for k in row[: len(seq.loss_mask)].tolist()]
    return {"off_policy_masked_frac": float((mask & ~kept).sum() / mask.sum().clamp(min=1))}


def first_update_mismatch(results: list[dict[str, float]], keep: bool) -> None:
    """Keep (with ``keep``) the trainers' ``mismatch_*`` numbers of the step's first update only, the one whose
    forward is the policy before the step (a later update's is after an update); none without ``keep``: when the
    controller measured the whole batch itself. (Under recompute the trainers report none: ``train/loss.py``.)
    In place."""
    for i, result in enumerate(results):
        if not keep or i > 0:
            for name in [k for k in result if k.startswith(PREFIX)]:
                del result[name]


def _padded(rows: list, dtype: torch.dtype) -> torch.Tensor:
    return pad_sequence([torch.tensor(r, dtype=dtype) for r in rows], batch_first=True)


def _loss_masks(sequences: list[SequenceData]) -> torch.Tensor:
    return _padded([s.loss_mask for s in sequences], torch.bool)
