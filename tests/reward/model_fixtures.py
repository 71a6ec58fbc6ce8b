"""Model rewards for the tests (``async def``, naming ``reward_model``), resolved by import as
``tests.reward.model_fixtures:NAME``."""

import asyncio


async def judged(prompt: str, completion: str, reward_model) -> float:
    """1.0 when the judge's answer to ``prompt + completion`` starts with Y."""
    said = await reward_model.generate(prompt + completion)
    return 1.0 if said.startswith("Y") else 0.0


async def scored(prompt: str, completion: str, reward_model) -> float:
    return await reward_model.classify(prompt + completion)


async def misbehaves(completion: str, reward_model) -> float:
    """Sleeps for "sleep", raises for "raise", else 2.0 (the reward model is never asked)."""
    if completion == "sleep":
        await asyncio.sleep(60)
    if completion == "raise":
        raise ValueError("the judge is unsure")
    return 2.0


async def no_model(prompt: str, completion: str) -> float:
    """An async def that takes no reward_model: refused."""
    return 0.0


def sync_model(prompt: str, completion: str, reward_model) -> float:
    """A plain def that takes reward_model: refused."""
    return 0.0


async def needs_column(completion: str, level: int, reward_model) -> float:
    return float(level)
