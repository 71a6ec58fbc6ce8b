"""The synthetic task of the default job: ``"a+b="`` -> ``(a+b) mod 10``, for single digits a and b.

Small enough that a tiny model learns it on CPU in minutes, which is what the end-to-end tests need;
``hpcrl.reward.builtin:mod10`` is its reward.
"""

from __future__ import annotations

import numpy as np
from datasets import Dataset, Features, Value

FEATURES = Features({"prompt": Value("string"), "answer": Value("string")})
_TRAIN, _EVAL = 0, 1  # the second word of each split's seed


def make_mod10(train_size: int, eval_size: int, seed: int) -> tuple[Dataset, Dataset]:
    """Training and held-out rows ``{"prompt": "a+b=", "answer": "d"}`` with d = (a+b) % 10.

    The two splits are drawn independently, from the seeds ``(seed, 0)`` and ``(seed, 1)``. There are
    only 100 distinct prompts, so the held-out split is separately drawn rows of the same distribution,
    not prompts the model has never seen: with a few hundred training rows nearly every prompt is in
    both. It measures how well the task is learnt, not generalisation to new prompts.
    """
    for name, size in (("train_size", train_size), ("eval_size", eval_size)):
        if not (isinstance(size, int) and size >= 0):
            raise ValueError(f"make_mod10: {name} must be an integer >= 0, got {size!r}")
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"make_mod10: seed must be an integer >= 0, got {seed!r}")
    return _draw(train_size, (seed, _TRAIN)), _draw(eval_size, (seed, _EVAL))


def _draw(size: int, seed: tuple[int, int]) -> Dataset:
    pairs = np.random.default_rng(seed).integers(0, 10, size=(size, 2)).tolist()
    prompts = [f"{a}+{b}=" for a, b in pairs]
    answers = [str((a + b) % 10) for a, b in pairs]
    return Dataset.from_dict({"prompt": prompts, "answer": answers}, features=FEATURES)
