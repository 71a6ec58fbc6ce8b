"""Reward functions for the controller's end-to-end tests, imported in the reward processes by name."""

import os
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


def _flagged() -> bool:
    """Whether the test has raised its flag: a file named by HPCRL_TEST_FLAG (inherited by reward processes)."""
    flag = os.environ.get("HPCRL_TEST_FLAG")
    return bool(flag) and os.path.exists(flag)


def mod10_then_slow(prompt: str, completion: str, answer: str) -> float:
    """The default task's reward until the test raises its flag, then minutes per call: a reward stuck in work."""
    if _flagged():
        time.sleep(600)
    return mod10(prompt, completion, answer)


def raises_after_flag(prompt: str, completion: str, answer: str) -> float:
    """The default task's reward until the test raises its flag, then an error for every call."""
    if _flagged():
        raise ValueError("no score once flagged")
    return mod10(prompt, completion, answer)


def mod10_in_processes(prompt: str, completion: str, answer: str) -> float:
    """The builtin mod10, not marked @in_process: scored in reward processes, as a user's reward is."""
    return mod10(prompt, completion, answer)
