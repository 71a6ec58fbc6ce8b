"""From scored groups to the trainer's sequences: advantages, loss masks, behaviour logprobs, versions; for PPO
with a critic, per-token GAE advantages and returns from the critic's values (``apply_gae``)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace

import torch

from hpcrl.config.schema import AlgorithmConfig
from hpcrl.rollout.workflows.base import Group
from hpcrl.rpc.messages import SequenceData
from hpcrl.train.algorithms import compute_advantages
from hpcrl.train.algorithms.gae import gae_advantages, outcome_token_rewards, whiten
from hpcrl.train.algorithms.value import explained_variance


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
                    # None: the servers were asked for none; the trainers' take their place (behaviour_logprobs)
                    old_logprobs=None if sample.logprobs is None else [0.0] * n_prompt + sample.logprobs,
                    prox_logprobs=None,
                    ref_logprobs=None,
                    versions=[-1] * n_prompt + sample.versions,
                )
            )
    return sequences


def _advantages(groups: list[Group], cfg: AlgorithmConfig) -> list[list[float]]:
    """Each group's advantages. A plug-in workflow's group may hold more than ``group_size`` samples (a conversation
    whose turns did not join trains as several trajectories, ``hpcrl/rollout/proxy``): then each group's are
    computed over its own samples (the whole batch's, for ``batch_norm``). ``gae``: 0 here, per-token advantages
    come later from the critic's values (``apply_gae``)."""
    rewards = [[s.reward for s in g.samples] for g in groups]
    if cfg.advantage == "gae":
        return [[0.0] * len(r) for r in rewards]
    if all(len(r) == cfg.group_size for r in rewards):
        return compute_advantages(torch.tensor(rewards, dtype=torch.float32), cfg).tolist()
    rows = [[x for r in rewards for x in r]] if cfg.advantage == "batch_norm" else rewards
    out = [compute_advantages(torch.tensor([r]), replace(cfg, group_size=len(r)))[0].tolist() for r in rows]
    flat = iter(x for row in out for x in row)
    return [[next(flat) for _ in r] for r in rewards]


def rollout_stats(groups: list[Group], trainer_version: int) -> dict[str, float]:
    """Reward and length statistics of a batch, and how stale its tokens are for this train step. With reward.fn a
    list, ``reward/<name>`` is the batch's mean of each function's own value (``reward_mean`` is of their weighted
    sum), over the samples scored with parts (one scored 0 under reward.on_error=zero has none).
    ``reward_zero_std_frac`` is the share of the batch's groups whose rewards are all equal: their group-normalised
    advantages are 0, so they give GRPO no gradient (TRL's ``frac_reward_zero_std``)."""
    rewards = [s.reward for g in groups for s in g.samples]
    lengths = [len(s.output_ids) for g in groups for s in g.samples]
    versions = [v for g in groups for s in g.samples for v in s.versions if v >= 0]  # sampled tokens only
    stale = [trainer_version - v for v in versions] or [0]
    counted = Counter[str]()  # what workflows counted (a plug-in's completions, joined turns, tool calls), per batch
    for g in groups:
        counted.update(g.counts)
    parts: dict[str, list[float]] = {}
    for sample in (s for g in groups for s in g.samples):
        for name, value in (sample.reward_parts or {}).items():
            parts.setdefault(f"reward/{name}", []).append(value)
    return {
        **counted,
        **{key: statistics.fmean(values) for key, values in parts.items()},
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "reward_zero_std_frac": statistics.fmean(len({s.reward for s in g.samples}) == 1 for g in groups),
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


def apply_gae(
    sequences: list[SequenceData], rewards: list[float], values: list[list[float]], cfg: AlgorithmConfig
) -> dict[str, float]:
    """PPO with a critic: set each sequence's per-token ``token_advantages`` (GAE with ``cfg.gamma`` and
    ``cfg.lam``, whitened over the batch's response tokens), ``returns`` (the critic's targets, not whitened)
    and ``old_values`` (``values``, the critic's before its update), all aligned with ``input_ids``; return the
    critic's metrics of this batch.

    ``rewards[i]`` is sequence i's outcome reward, placed on its last response token; ``values[i][t]`` the value
    of the state in which token t was chosen. Tokens outside the loss mask (prompt, tool output between turns)
    are skipped by the recursion and get 0. ``critic_explained_var`` compares the values before the update with
    this batch's returns: above 0, the critic knows more than the mean return.
    """
    width = max(len(s.input_ids) for s in sequences)
    mask = torch.zeros(len(sequences), width)
    old = torch.zeros(len(sequences), width)
    for row, (seq, vals) in enumerate(zip(sequences, values, strict=True)):
        if len(vals) != len(seq.input_ids):
            raise ValueError(f"sequence {row}: {len(vals)} values for {len(seq.input_ids)} tokens")
        mask[row, : len(vals)] = torch.tensor(seq.loss_mask, dtype=torch.float32)
        old[row, : len(vals)] = torch.tensor(vals, dtype=torch.float32)
    token_rewards = outcome_token_rewards(torch.tensor(rewards, dtype=torch.float32), mask)
    advantages, returns = gae_advantages(token_rewards, old, mask, cfg.gamma, cfg.lam)
    advantages = whiten(advantages, mask)
    for row, seq in enumerate(sequences):
        n = len(seq.input_ids)
        seq.token_advantages = advantages[row, :n].tolist()
        seq.returns = returns[row, :n].tolist()
        seq.old_values = old[row, :n].masked_fill(mask[row, :n] == 0, 0.0).tolist()
    keep = mask != 0
    count = keep.sum().clamp(min=1)
    return {
        "critic_explained_var": explained_variance(old, returns, mask),
        "critic_value_mean": float(old.masked_fill(~keep, 0).sum() / count),
        "return_mean": float(returns.masked_fill(~keep, 0).sum() / count),
    }
