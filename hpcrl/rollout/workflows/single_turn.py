"""Single-turn RLVR: one prompt, a group of samples, each scored by the reward function.

The group goes to a server as one batched request (SGLang's ``input_ids`` as a list of prompts, one
``sampling_params`` each): one HTTP round trip, not one per sample. A weight update aborts the servers'
requests (``abort_all_requests`` on a disk load, an ``abort``-mode pause around a distributed push): each
interrupted sample comes back with the tokens it had, and goes on from there once
generation resumes (the prompt plus those tokens, with the remaining token budget; a group's interrupted
samples go on together in one request), so no work is lost and no sample is cut short by an update.

A server that aborts every request (not a weight update's abort) would have a sample resubmitted without end,
so it is bounded: ``max_empty_aborts`` answers in a row that come back aborted with no new token while
generation is not paused fail the sample with ``NoProgress``, an ``InferenceError`` naming the server and the
abort's message (its group is dropped and counted as ``failed``, as a request the client's retries could not
save). A weight update's aborts never count: ``resumed`` is cleared before the servers are told to abort and
set only once they hold the new weights (``controller/weights.py``), so its aborts come back while it is clear;
and an answer with any new token starts the count again, so a long run's updates are never bounded in number.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from hpcrl.inference.client import GenerateResult, InferenceClient, InferenceError
from hpcrl.inference.context import max_input_len
from hpcrl.rollout.workflows.base import Group, Rewarder, Sample, derive_seed, version_number

MAX_EMPTY_ABORTS = 8  # rollout.max_empty_aborts's default


class NoProgress(InferenceError):
    """A sample's requests came back aborted with no new token ``max_empty_aborts`` times in a row while
    generation was not paused: the server aborts what it is sent, so sending it again cannot help."""


class SingleTurn:
    """Sample ``group_size`` completions of one prompt and score them."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        sampling: dict[str, Any],
        group_size: int,
        rewards: Rewarder,
        resumed: asyncio.Event,  # set while generation runs; cleared during a weight update
        *,
        max_empty_aborts: int = MAX_EMPTY_ABORTS,  # aborted answers in a row with no token, unpaused, fail a sample
        logprobs: bool = True,  # ask the servers for the sampled tokens' logprobs; False: samples carry None
    ):
        if "max_new_tokens" not in sampling:
            raise ValueError("sampling must set max_new_tokens (the server's default of 128 is never wanted)")
        if max_empty_aborts < 1:
            raise ValueError(f"max_empty_aborts must be >= 1, got {max_empty_aborts}")
        self.client, self.tokenizer, self.sampling = client, tokenizer, sampling
        self.group_size, self.rewards, self.resumed = group_size, rewards, resumed
        self.max_empty_aborts, self.logprobs = max_empty_aborts, logprobs

    async def run(
        self, prompt: str, answer: str, seed: int | None = None, columns: Mapping[str, Any] | None = None
    ) -> Group:
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        group = Group(prompt, answer, prompt_ids)
        seeds = [derive_seed(seed, "sample", i) for i in range(self.group_size)]
        group.samples = await self.sample_group(prompt_ids, seeds)
        outcomes = await self.rewards.score([(prompt, s.text, answer, columns or {}) for s in group.samples])
        for sample, outcome in zip(group.samples, outcomes, strict=True):
            sample.reward, sample.reward_error, sample.reward_parts = outcome.value, outcome.error, outcome.parts
        return group

    async def sample_group(self, prompt_ids: list[int], seeds: list[int | None]) -> list[Sample]:
        """One completion per seed, all in one batched request; after an abort, the interrupted ones are sent
        again together, each from its tokens so far with its remaining budget, until every one has ended.
        Raises ``NoProgress`` when one came back aborted with no new token ``max_empty_aborts`` times in a row
        while generation was not paused (module docstring)."""
        budget = self.sampling["max_new_tokens"]
        samples = [Sample([], [] if self.logprobs else None, [], "") for _ in seeds]
        empty: list[list[GenerateResult]] = [[] for _ in seeds]  # each sample's answers since its last new token
        pending = list(range(len(seeds)))
        while pending:
            await self.resumed.wait()
            params = [self._params(budget, len(samples[i].output_ids), seeds[i]) for i in pending]
            prompts = [prompt_ids + samples[i].output_ids for i in pending]
            results = await self._generate(prompts, params)
            paused = not self.resumed.is_set()  # a weight update aborted what ran: not the server's fault
            for i, result in zip(pending, results, strict=True):
                _extend(samples[i], result)
                empty[i] = _empty_aborts(empty[i], result, paused)
                if len(empty[i]) >= self.max_empty_aborts:
                    raise _no_progress(empty[i])
            pending = [
                i for i in pending if _interrupted(samples[i], budget) and self._resumable(prompt_ids, samples[i])
            ]
        for sample in samples:
            sample.finish_reason = "length" if sample.finish_reason == "abort" else sample.finish_reason
            sample.text = self.tokenizer.decode(sample.output_ids, skip_special_tokens=True)
        return samples

    async def _generate(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[Any]:
        """One request for all the prompts: a batch, or a plain request when there is one."""
        if len(prompts) == 1:
            return [await self.client.generate(prompts[0], params[0], return_logprob=self.logprobs)]
        return await self.client.generate_many(prompts, params, return_logprob=self.logprobs)

    def _params(self, budget: int, done: int, seed: int | None) -> dict[str, Any]:
        """The sampling parameters of a request that has ``done`` of its ``budget`` tokens already."""
        params = {**self.sampling, "max_new_tokens": budget - done}
        if seed is not None:
            params["sampling_seed"] = derive_seed(seed, done)
        return params

    def _resumable(self, prompt_ids: list[int], sample: Sample) -> bool:
        """Whether SGLang takes the interrupted sample's prompt plus its tokens so far as a prompt: one that reaches
        its margin below the context (``context.max_input_len``) is refused, so the sample ends there, as "length"
        (it was a handful of tokens from SGLang's own early stop), not as a request the client refuses."""
        context = getattr(self.client, "context_length", None)
        return context is None or len(prompt_ids) + len(sample.output_ids) < max_input_len(context)

    async def sample(self, prompt_ids: list[int], seed: int | None = None) -> Sample:
        """One completion (a group of one), resubmitted after an abort until its token budget or a stop ends it;
        with a ``seed`` every request carries a sampling seed of its own (a resubmission's is derived from the
        tokens so far). Raises ``NoProgress`` as ``sample_group`` does."""
        (sample,) = await self.sample_group(prompt_ids, [seed])
        return sample


def _extend(sample: Sample, result: Any) -> None:
    """Add one answer's tokens to a sample; its finish reason is the answer's."""
    sample.output_ids += result.output_ids
    if sample.logprobs is not None:  # None: the servers were asked for none
        sample.logprobs += result.logprobs
    sample.versions += [version_number(result.weight_version)] * len(result.output_ids)
    sample.finish_reason = result.finish_reason


def _interrupted(sample: Sample, budget: int) -> bool:
    """Whether an abort cut the sample short of its token budget (it goes on after the resume)."""
    return sample.finish_reason == "abort" and len(sample.output_ids) < budget


def _empty_aborts(before: list[GenerateResult], result: GenerateResult, paused: bool) -> list[GenerateResult]:
    """A sample's answers since its last new token that count towards ``max_empty_aborts``, after ``result``:
    a new token clears them; an abort with none while generation runs (not ``paused``) is one more."""
    if result.output_ids:
        return []
    return [*before, result] if result.finish_reason == "abort" and not paused else before


def _no_progress(aborts: list[GenerateResult]) -> NoProgress:
    """The error of a sample whose last answers (``aborts``) were all aborted with no new token while unpaused."""
    servers = list(dict.fromkeys(a.server for a in aborts))
    finish = aborts[-1].meta_info.get("finish_reason")
    message = finish.get("message") if isinstance(finish, dict) else None
    return NoProgress(
        f"POST /generate on {', '.join(servers)} answered a sample aborted with no new token {len(aborts)} times in "
        f"a row while generation was not paused (rollout.max_empty_aborts={len(aborts)}); the abort's message: "
        f"{message!r}. The server aborts what it is sent: see its log",
        server=servers[-1],
        endpoint="/generate",
    )
