"""From scored groups to the trainer's sequences: advantages, loss masks, behaviour logprobs, versions."""

from __future__ import annotations

import statistics

import torch

from hpcrl.config.schema import AlgorithmConfig
from hpcrl.rollout.workflows.base import Group
from hpcrl.rpc.messages import SequenceData
from hpcrl.train.algorithms import compute_advantages


def to_sequences(groups: list[Group], cfg: AlgorithmConfig) -> list[SequenceData]:
    """One sequence per sample: prompt then trajectory; loss on the tokens the model sampled only."""
    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
    advantages = compute_advantages(rewards, cfg).tolist()
    sequences = []
    for group, row in zip(groups, advantages, strict=True):
        n_prompt = len(group.prompt_ids)
        for sample, advantage in zip(group.samples, row, strict=True):
            sequences.append(
                SequenceData(
                    input_ids=group.prompt_ids + sample.output_ids,
                    loss_mask=[0] * n_prompt + sample.mask(),
                    advantage=float(advantage),
                    old_logprobs=[0.0] * n_prompt + sample.logprobs,
                    prox_logprobs=None,
                    ref_logprobs=None,
                    versions=[-1] * n_prompt + sample.versions,
                )
            )
    return sequences


def rollout_stats(groups: list[Group], trainer_version: int) -> dict[str, float]:
    """Reward and length statistics of a batch, and how stale its tokens are for this train step."""
    rewards = [s.reward for g in groups for s in g.samples]
    lengths = [len(s.output_ids) for g in groups for s in g.samples]
    versions = [v for g in groups for s in g.samples for v in s.versions if v >= 0]  # sampled tokens only
    stale = [trainer_version - v for v in versions] or [0]
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "completion_len_mean": statistics.fmean(lengths),
        "completion_len_min": min(lengths),
        "completion_len_max": max(lengths),
        "staleness_max": max(stale),
        "staleness_mean": statistics.fmean(stale),
        "token_version_min": min(versions, default=trainer_version),
    }


def shard(sequences: list[SequenceData], ranks: int) -> list[list[SequenceData]]:
    """Split a batch over trainer ranks with about equal token counts (longest first, to the lightest rank)."""
    shards: list[list[SequenceData]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for seq in sorted(sequences, key=lambda s: len(s.input_ids), reverse=True):
        lightest = load.index(min(load))
        shards[lightest].append(seq)
        load[lightest] += len(seq.input_ids)
    return shards
