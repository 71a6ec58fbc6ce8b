"""Single-turn RLVR: one prompt, a group of samples, each scored by the reward function.

A weight update pauses the servers in ``abort`` mode: the interrupted request comes back with the
tokens it had, and the sample goes on from there once generation resumes (the prompt plus those
tokens, with the remaining token budget), so no work is lost and no sample is cut short by an update.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hpcrl.inference.client import InferenceClient
from hpcrl.rollout.workflows.base import Group, Rewarder, Sample, derive_seed, version_number


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

    async def run(self, prompt: str, answer: str, seed: int | None = None) -> Group:
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        group = Group(prompt, answer, prompt_ids)
        samples = (self.sample(prompt_ids, derive_seed(seed, "sample", i)) for i in range(self.group_size))
        group.samples = list(await asyncio.gather(*samples))
        outcomes = await self.rewards.score([(prompt, s.text, answer) for s in group.samples])
        for sample, outcome in zip(group.samples, outcomes, strict=True):
            sample.reward, sample.reward_error = outcome.value, outcome.error
        return group

    async def sample(self, prompt_ids: list[int], seed: int | None = None) -> Sample:
        """One completion, resubmitted after an abort until its token budget or a stop ends it; with a ``seed``
        every request carries a sampling seed of its own (a resubmission's is derived from the tokens so far)."""
        budget = self.sampling["max_new_tokens"]
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            await self.resumed.wait()
            params = {**self.sampling, "max_new_tokens": budget - len(out)}
            if seed is not None:
                params["sampling_seed"] = derive_seed(seed, len(out))
            result = await self.client.generate(prompt_ids + out, params)
            out += result.output_ids
            logprobs += result.logprobs
            versions += [version_number(result.weight_version)] * len(result.output_ids)
            if result.finish_reason != "abort" or len(out) >= budget:
                reason = result.finish_reason if result.finish_reason != "abort" else "length"
                break
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        return Sample(out, logprobs, versions, reason, text)
