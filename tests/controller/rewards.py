"""Reward functions for the controller's end-to-end tests, imported in the reward processes by name."""

import time

from hpcrl.reward.builtin import mod10


def mod10_slow_for_some(prompt: str, completion: str, answer: str) -> float:
    """The default task's reward, taking 0.5 s for one prompt in four (by its characters, the same in every
    process): the groups of those prompts finish well after groups started after them."""
    if sum(map(ord, prompt)) % 4 == 0:
        time.sleep(0.5)
    return mod10(prompt, completion, answer)


def always_raises(prompt: str, completion: str, answer: str) -> float:
    """A reward that cannot score anything: every group is dropped under reward.on_error=drop."""
    raise ValueError(f"no score for {completion!r}")
