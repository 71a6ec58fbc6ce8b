"""Reward functions for the tests, resolved by import in the worker processes as ``tests.reward.fixtures:NAME``."""

import os
import sys
import time

from hpcrl.reward.registry import in_process

NOT_CALLABLE = 3


def behave(prompt: str, completion: str, answer: str) -> float:
    """1.0 if completion == answer, else 0.0; some completions make it misbehave instead."""
    if completion == "hang":
        time.sleep(60)
    elif completion.startswith("sleep:"):
        time.sleep(float(completion.removeprefix("sleep:")))
    elif completion == "die":
        os._exit(3)
    elif completion == "raise":
        raise ValueError(f"cannot score answer {answer!r}")
    elif completion == "exit":
        sys.exit(4)
    return 1.0 if completion == answer else 0.0


def worker_pid(prompt: str, completion: str, answer: str) -> int:
    """The PID of the process the call ran in (an int: the pool converts it)."""
    return os.getpid()


def returns(prompt: str, completion: str, answer: str) -> object:
    """Returns what ``completion`` names: a bool, a str, NaN, None."""
    return {"true": True, "str": "yes", "nan": float("nan"), "inf": float("inf"), "none": None}[completion]


def noisy(prompt: str, completion: str, answer: str) -> float:
    """Writes to stdout (what the worker's wire would be, were it not moved aside) and reads stdin."""
    print('{"v": 99.0}', flush=True)
    sys.stdout.write("not json\n")
    sys.stdout.flush()
    assert sys.stdin.read() == ""  # /dev/null in a worker
    return 0.5


@in_process
def here_pid(prompt: str, completion: str, answer: str) -> int:
    """The PID of the process that scores; raises on "raise" (marked @in_process, so that is the caller's)."""
    if completion == "raise":
        raise ValueError(f"cannot score answer {answer!r}")
    return os.getpid()


def in_range(completion: str, low: int, high: int) -> float:
    """1.0 if the completion is a number in [low, high], the row's columns "low" and "high"."""
    return 1.0 if low <= float(completion) <= high else 0.0


def level_and_names(completion: str, **row: object) -> float:
    """10 x the row's column "level", plus how many names came in ``row`` (every name but completion)."""
    return 10 * row["level"] + len(row)


@in_process
def here_length(completion: str) -> int:
    """The completion's length (marked @in_process)."""
    return len(completion)


@in_process
def here_answer_is_digit(answer: str) -> bool:
    """Whether the reference answer is a digit (marked @in_process)."""
    return answer.isdigit()


def positional(prompt, completion, answer, /):  # type: ignore[no-untyped-def]
    """Takes its arguments by position only, which a reward cannot."""
    return 0.0


def bonus(completion: str, bonus: float) -> float:
    """The row's column "bonus", whatever the completion."""
    return bonus
