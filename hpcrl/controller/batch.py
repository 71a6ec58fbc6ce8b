"""From scored groups to the trainer's sequences: advantages, loss masks, behaviour logprobs, versions."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace

import torch

from hpcrl.config.schema import AlgorithmConfig
from hpcrl.rollout.workflows.base import Group
from hpcrl.rpc.messages import SequenceData
from hpcrl.train.algorithms import compute_advantages


def to_sequences(groups: list[Group], cfg: AlgorithmConfig) -> list[SequenceData]:
    """One sequence per sample: prompt then trajectory; loss on the tokens the model sampled only."""
    advantages = _advantages(groups, cfg)
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


def _advantages(groups: list[Group], cfg: AlgorithmConfig) -> list[list[float]]:
    """Each group's advantages. A plug-in workflow's group may hold more than ``group_size`` samples (a conversation
    whose turns did not join trains as several trajectories, ``hpcrl/rollout/proxy``): then each group's are
    computed over its own samples (the whole batch's, for ``batch_norm``)."""
    rewards = [[s.reward for s in g.samples] for g in groups]
    if all(len(r) == cfg.group_size for r in rewards):
        return compute_advantages(torch.tensor(rewards, dtype=torch.float32), cfg).tolist()
    rows = [[x for r in rewards for x in r]] if cfg.advantage == "batch_norm" else rewards
    out = [compute_advantages(torch.tensor([r]), replace(cfg, group_size=len(r)))[0].tolist() for r in rows]
    flat = iter(x for row in out for x in row)
    return [[next(flat) for _ in r] for r in rewards]


def rollout_stats(groups: list[Group], trainer_version: int) -> dict[str, float]:
    """Reward and length statistics of a batch, and how stale its tokens are for this train step."""
    rewards = [s.reward for g in groups for s in g.samples]
    lengths = [len(s.output_ids) for g in groups for s in g.samples]
    versions = [v for g in groups for s in g.samples for v in s.versions if v >= 0]  # sampled tokens only
    stale = [trainer_version - v for v in versions] or [0]
    counted = Counter[str]()  # what workflows counted (a plug-in's completions, joined turns, tool calls), per batch
    for g in groups:
        counted.update(g.counts)
    return {
        **counted,
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
