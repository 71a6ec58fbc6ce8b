"""What the proxy records of one episode: every completion it returned, exactly as generated, and its reward.

A completion is one choice of one response: the prompt's token ids as the proxy rendered and sent them, the
output token ids as the server generated them, their logprobs and the weight version of each. The text the
agent received is derived from these, never the other way round. ``set_reward`` names a response by its id
(``response.id``), as the agent holds it; all choices of a response get the reward unless ``index`` names one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from hpcrl.reward.registry import to_reward
from hpcrl.rollout.workflows.base import derive_seed


@dataclass
class Completion:
    id: str  # the response's id, which set_reward names
    index: int  # the choice's index in its response
    order: int  # when it was made, within the episode (0, 1, ...)
    prompt_ids: list[int]  # exactly what was sent to the server
    output_ids: list[int]  # exactly what the server generated (a stop token included)
    logprobs: list[float] | None  # of each output token, as the server sampled it; None: not asked for (recompute)
    versions: list[int]  # the weight version that produced each output token
    finish_reason: str = "stop"  # stop | length | tool_calls
    text: str = ""  # the content the agent received
    tool_calls: int = 0  # calls parsed from it
    reward: float | None = None  # set by the episode (set_reward, or its return value), then propagated


@dataclass
class EpisodeLog:
    """One episode's completions, in the order they were made; ``sampling`` and ``seed`` are its defaults."""

    key: str  # the episode's part of the proxy's URL
    sampling: dict[str, Any]  # SGLang sampling parameters the proxy applies when the request does not set them
    seed: int | None = None  # the episode's seed: every request's sampling seed derives from it
    completions: list[Completion] = field(default_factory=list)
    error: BaseException | None = None  # the last inference error the proxy answered this episode with
    requests: int = 0  # requests served, for their seeds
    tasks: set[asyncio.Task] = field(default_factory=set)  # requests being served (cancelled when it closes)
    closed: bool = False

    def add(self, completion: Completion) -> None:
        completion.order = len(self.completions)
        self.completions.append(completion)

    def request_seed(self, request_seed: int | None, request: int, choice: int) -> int | None:
        """The seed of one choice of one request: from the request's own seed if it sent one, else the episode's."""
        if request_seed is not None:
            return derive_seed(request_seed, "choice", choice)
        return derive_seed(self.seed, "request", request, "choice", choice)

    def set_reward(self, completion_id: str, reward: float, index: int | None = None) -> None:
        """The reward of the completion(s) of the response ``completion_id`` (one choice with ``index``)."""
        try:
            value = to_reward(reward)
        except (TypeError, ValueError) as e:
            raise ValueError(f"set_reward({completion_id!r}, {reward!r}): {str(e).removeprefix('returned ')}") from e
        hits = [c for c in self.completions if c.id == completion_id and (index is None or c.index == index)]
        if not hits:
            known = sorted({c.id for c in self.completions})
            raise ValueError(
                f"set_reward: no completion {completion_id!r}"
                + (f" with index {index}" if index is not None else "")
                + f" in this episode; its completions are {known or 'none yet'}"
            )
        for c in hits:
            c.reward = value
