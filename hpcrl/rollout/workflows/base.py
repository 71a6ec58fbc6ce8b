"""What every workflow shares: a trajectory (``Sample``), an episode's result (``Group``), the
``Workflow`` and ``Rewarder`` interfaces, and the sampling parameters every rollout request sends.

Every generated token carries the weight version of the server that produced it (``version_number``).

Seeds: an episode may get a seed (the controller derives one from ``run.seed`` and the row's draw number);
every request it sends then carries SGLang's ``sampling_params.sampling_seed``, derived from it and where the
request is in the episode (``derive_seed``: the sample's index, the turn, the tokens already generated), so
the same seed and the same weights give the same samples.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol


class Rewarder(Protocol):
    async def score(self, items: list[tuple[str, str, str]]) -> list[Any]: ...


@dataclass
class Sample:
    """One trajectory after the prompt: the model's tokens and, in multi-turn or pipeline workflows, the
    tokens put between its turns (feedback, a stage's instructions), which are not trained on."""

    output_ids: list[int]
    logprobs: list[float]  # of each output token, as the server sampled it (tempered); 0.0 for tokens not sampled
    versions: list[int]  # weight version that produced each output token; -1 for tokens not sampled
    finish_reason: str
    text: str = ""  # what the reward reads (the model's final answer in a multi-turn trajectory)
    reward: float | None = None
    reward_error: str | None = None
    loss_mask: list[int] | None = None  # 1 for each token the model sampled; None: every output token is
    turns: int = 1  # model turns in the trajectory

    def mask(self) -> list[int]:
        """The loss mask over ``output_ids``: 1 where the model sampled the token."""
        return [1] * len(self.output_ids) if self.loss_mask is None else self.loss_mask


@dataclass
class Group:
    """One episode: a prompt and its samples."""

    prompt: str
    answer: str
    prompt_ids: list[int]
    samples: list[Sample] = field(default_factory=list)

    def min_version(self) -> int:
        return min((v for s in self.samples for v in s.versions), default=0)


class Workflow(Protocol):
    """One episode: a prompt and its reference answer in, a scored ``Group`` out.

    Episodes run concurrently on one workflow object: an episode's state lives in its own call (its
    arguments and locals), never in attributes of the workflow.
    """

    async def run(self, prompt: str, answer: str, seed: int | None = None) -> Group: ...


def sampling_params(rollout: Any) -> dict[str, Any]:
    """The sampling parameters every rollout request sends, from the config's ``rollout`` section."""
    params = {
        "max_new_tokens": rollout.max_new_tokens,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": rollout.top_k,
    }
    if rollout.stop:
        params["stop"] = list(rollout.stop)
    return params


def derive_seed(seed: int | None, *parts: object) -> int | None:
    """A seed in [0, 2**63) for a part of what ``seed`` seeds (a sample, a turn, a request), the same in every
    process and run (not Python's salted ``hash``); None stays None (no seed: the server's own randomness)."""
    if seed is None:
        return None
    digest = hashlib.blake2b("/".join(map(str, (seed, *parts))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def version_number(weight_version: Any) -> int:
    """SGLang reports weight versions as strings; before any update it says "default" (version 0)."""
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        return 0
