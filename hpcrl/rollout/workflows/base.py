"""Single-turn RLVR: one prompt, a group of samples, each scored by the reward function.

Every generated token carries the weight version of the server that produced it. A weight update
pauses the servers in ``abort`` mode: the interrupted request comes back with the tokens it had, and
the sample goes on from there once generation resumes (the prompt plus those tokens, with the
remaining token budget), so no work is lost and no sample is cut short by an update.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from hpcrl.inference.client import InferenceClient


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

    async def run(self, prompt: str, answer: str) -> Group: ...


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


def version_number(weight_version: Any) -> int:
    """SGLang reports weight versions as strings; before any update it says "default" (version 0)."""
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        return 0


class SingleTurn:
    """Sample ``group_size`` completions of one prompt and score them."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        sampling: dict[str, Any],
        group_size: int,
        rewards: Rewarder,
        resumed: asyncio.Event,
    ):
        if "max_new_tokens" not in sampling:
            raise ValueError("sampling must set max_new_tokens (the server's default of 128 is never wanted)")
        self.client, self.tokenizer, self.sampling = client, tokenizer, sampling
        self.group_size, self.rewards, self.resumed = group_size, rewards, resumed

    async def run(self, prompt: str, answer: str) -> Group:
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        group = Group(prompt, answer, prompt_ids)
        group.samples = list(await asyncio.gather(*(self.sample(prompt_ids) for _ in range(self.group_size))))
        outcomes = await self.rewards.score([(prompt, s.text, answer) for s in group.samples])
        for sample, outcome in zip(group.samples, outcomes, strict=True):
            sample.reward, sample.reward_error = outcome.value, outcome.error
        return group

    async def sample(self, prompt_ids: list[int]) -> Sample:
        """One completion, resubmitted after an abort until its token budget or a stop ends it."""
        budget = self.sampling["max_new_tokens"]
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            await self.resumed.wait()
            params = {**self.sampling, "max_new_tokens": budget - len(out)}
            result = await self.client.generate(prompt_ids + out, params)
            out += result.output_ids
            logprobs += result.logprobs
            versions += [version_number(result.weight_version)] * len(result.output_ids)
            if result.finish_reason != "abort" or len(out) >= budget:
                reason = result.finish_reason if result.finish_reason != "abort" else "length"
                break
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        return Sample(out, logprobs, versions, reason, text)
