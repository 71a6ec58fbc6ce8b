"""Held-out evaluation: greedy completions of every held-out prompt, or the answers a scaffolding controller
chooses, scored by the run's reward, or by ``eval.reward_fn`` when it names one (an exact match, say, while a judge
gives the training reward: the accuracy then measures the task, not the judge's opinion)."""

from __future__ import annotations

import asyncio
import statistics
from typing import TYPE_CHECKING, Any

from hpcrl.config.schema import Config
from hpcrl.inference.client import InferenceClient
from hpcrl.rollout.workflows.scaffold import Controller, Episode

if TYPE_CHECKING:
    from hpcrl.reward.pool import RewardPool


def eval_reward_pool(cfg: Config, rewards: RewardPool) -> RewardPool | None:
    """The held-out reward's own pool when ``eval.reward_fn`` names one (started, with the run pool ``rewards``'s
    settings and reward-model servers; its owner closes it), else None: the run's reward scores the held-out rows."""
    return rewards.sibling(cfg.eval.reward_fn) if cfg.eval.reward_fn else None


async def greedy_accuracy(
    client: InferenceClient, tokenizer: Any, rows: list[dict[str, Any]], rewards: Any, max_new_tokens: int
) -> float:
    """Mean reward of greedy completions (for 0/1 rewards: the fraction answered correctly)."""
    scored = await greedy_scored(client, tokenizer, rows, rewards, max_new_tokens)
    return mean_reward([reward for _, reward in scored])


def mean_reward(rewards: list[float | None]) -> float:
    """The accuracy of scored rows: their mean reward, a row the reward could not score (None) counting 0."""
    return statistics.fmean(r if r is not None else 0.0 for r in rewards)


async def greedy_scored(
    client: InferenceClient, tokenizer: Any, rows: list[dict[str, Any]], rewards: Any, max_new_tokens: int
) -> list[tuple[str, float | None]]:
    """Each row's greedy completion and its reward (None where the reward could not score it), in row order."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}

    async def one(row: dict[str, Any]) -> str:
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        result = await client.generate(ids, params, return_logprob=False)
        return tokenizer.decode(result.output_ids, skip_special_tokens=True)

    completions = await asyncio.gather(*(one(r) for r in rows))
    outcomes = await rewards.score(
        [(r["prompt"], c, r["answer"], r.get("columns") or {}) for r, c in zip(rows, completions, strict=True)]
    )
    return [(c, o.value) for c, o in zip(completions, outcomes, strict=True)]


async def controller_accuracy(
    controller: Controller, tokenizer: Any, rows: list[dict[str, Any]], rewards: Any
) -> float:
    """Mean reward of the answers a scaffolding controller chooses (with its own sampling parameters)."""
    episodes = [Episode.of(r["prompt"], r["answer"], tokenizer, columns=r.get("columns")) for r in rows]
    results = await asyncio.gather(*(controller.run(e) for e in episodes))
    outcomes = await rewards.score([e.scored(r.text) for e, r in zip(episodes, results, strict=True)])
    return mean_reward([o.value for o in outcomes])
