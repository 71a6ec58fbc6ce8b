"""A second module of test rewards: a function of the same name as one in ``fixtures``."""


def behave(prompt: str, completion: str, answer: str) -> float:
    return 0.0
