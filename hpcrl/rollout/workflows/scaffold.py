"""Scaffolding: inference-time controllers that compose generations into one chosen answer.

    Generate                       one completion (SingleTurn's abort-resume loop)
    BestOfN(inner, n, verifier)    n runs of inner at once, each scored by the verifier; the best is chosen
    MajorityVote(inner, n, extract)  n runs; the most common extracted answer is chosen
    Pipeline([Stage(template, controller), ...])  stages in turn, each prompted with the previous one's answer

    episode = Episode.of(prompt, answer, tokenizer)          # immutable: all an episode's data
    result = await controller.run(episode)                   # text (chosen), chosen, samples (every trajectory)

Episodes run concurrently on the same controllers, so a controller holds only its configuration and
shared services (client, tokenizer, sampling parameters, verifier); everything about an episode
travels in its ``Episode`` and in the ``Result`` it returns. Every request sends the ``sampling``
parameters the controllers were built with (the config's ``rollout`` section), in training and eval.

Trajectories. Every ``Sample`` a controller returns is a trajectory after ``episode.prompt_ids``, so
``prompt_ids + sample.output_ids`` is one training sequence (``controller/batch.py``). A pipeline
never re-tokenises what the model wrote: stage k generates after the sequence so far (the episode's
prompt, every earlier stage's chosen tokens and the stages' prompt tokens) plus the tokens its own
prompt adds. A stage's rendered prompt adds only what the sequence does not already say: when it
begins with the sequence's text (``"{prompt}{previous}|"`` after ``prompt`` and ``previous``), only
the rest (``"|"``) is tokenised and appended; otherwise all of it is. Those appended tokens carry loss
mask 0, logprob 0.0 and version -1; the model's tokens (an end-of-sequence token that ended a stage
included) keep mask 1. So what the trainer sees is exactly what the model conditioned on. The price:
the model reads its earlier stages as it wrote them, not as the template's text would tokenise.

A pipeline's trajectories: the chosen path through every stage (the chosen trajectory), plus each
candidate a stage did not choose (a best-of-N stage's losers), each after the chosen path that led to
its stage. Their ``text`` is the text of their last stage, which is what the reward reads.

As a rollout workflow (``scaffold_workflow``), one episode's ``Group`` is the trajectories of several
controller runs, each scored by the task reward: every trajectory of a run (``workflow.train_on=all``)
or its chosen one (``chosen``). The trainer compares rewards within groups of exactly
``algorithm.group_size`` samples, so that is the group's size and the number of runs follows from it
(``runs_per_group``): group_size runs under ``chosen``; group_size / n runs of a best-of-N or
majority vote under ``all``, each run giving its n candidates; group_size runs of a pipeline, which
gives one trajectory per run when its stages are single generations, as the config builds them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from hpcrl.config.schema import Config, WorkflowConfig
from hpcrl.inference.client import InferenceClient
from hpcrl.reward.builtin import extract_answer
from hpcrl.reward.pool import RewardPool
from hpcrl.rollout.workflows.base import Group, Rewarder, Sample, behaviour_logprobs, derive_seed, joined_logprobs
from hpcrl.rollout.workflows.single_turn import MAX_EMPTY_ABORTS, SingleTurn

__all__ = [
    "BestOfN",
    "Controller",
    "Episode",
    "Generate",
    "MajorityVote",
    "Pipeline",
    "Result",
    "ScaffoldWorkflow",
    "Stage",
    "make_controller",
    "runs_per_group",
    "scaffold_workflow",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Episode:
    """One episode's data, all of it: what the model is asked, the reference answer, the prompt's tokens, the
    seed its requests' sampling seeds derive from (None: none), and the row's columns the rewards take."""

    prompt: str
    answer: str
    prompt_ids: tuple[int, ...]
    seed: int | None = None
    columns: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls, prompt: str, answer: str, tokenizer: Any, seed: int | None = None, columns: Mapping[str, Any] | None = None
    ) -> Episode:
        ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return cls(prompt, answer, ids, seed, columns or {})

    def scored(self, text: str) -> tuple[str, str, str, Mapping[str, Any]]:
        """The reward's item for ``text``, an answer to this episode."""
        return (self.prompt, text, self.answer, self.columns)


@dataclass(frozen=True)
class Result:
    """What one controller run produced."""

    text: str  # the chosen answer
    chosen: Sample  # the trajectory that led to it; one of ``samples``
    samples: tuple[Sample, ...]  # every trajectory of the run, each after the episode's prompt_ids
    scores: tuple[float | None, ...] = ()  # per candidate: the verifier's score | the votes for its answer


class Controller(Protocol):
    async def run(self, episode: Episode) -> Result: ...


class Generate:
    """One completion of the episode's prompt."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        sampling: dict[str, Any],
        resumed: asyncio.Event,
        max_empty_aborts: int = MAX_EMPTY_ABORTS,  # aborted answers in a row with no token, unpaused, that fail it
        logprobs: bool = True,  # ask the servers for the sampled tokens' logprobs; False: samples carry None
    ):
        # SingleTurn's sample loop (resubmit after an abort with the remaining budget, bounded when no token comes)
        # is reused as is; only ``sample`` is called, which scores nothing, so it gets no rewards
        no_rewards: Any = None
        self._single = SingleTurn(
            client, tokenizer, sampling, 1, no_rewards, resumed, max_empty_aborts=max_empty_aborts, logprobs=logprobs
        )

    async def run(self, episode: Episode) -> Result:
        sample = await self._single.sample(list(episode.prompt_ids), episode.seed)
        return Result(sample.text, sample, (sample,))


class BestOfN:
    """``n`` runs of ``inner``, the best by the verifier chosen (the first of equals; a failed score last)."""

    def __init__(self, inner: Controller, n: int, verifier: Rewarder):
        if n < 1:
            raise ValueError(f"BestOfN: n must be >= 1, got {n}")
        self.inner, self.n, self.verifier = inner, n, verifier

    async def run(self, episode: Episode) -> Result:
        results = await _runs(self.inner, episode, self.n)
        outcomes = await self.verifier.score([episode.scored(r.text) for r in results])
        failed = [o.error for o in outcomes if o.value is None]
        if failed:
            log.warning("best-of-%d: %d verifier call(s) failed, ranked last: %s", self.n, len(failed), failed[0])
        return _choose(results, [o.value for o in outcomes])


class MajorityVote:
    """``n`` runs of ``inner``; the first run whose extracted answer is the most common one is chosen.

    A run without an answer (``extract`` gives None) casts no vote; when none has one, the first run is chosen.
    """

    def __init__(self, inner: Controller, n: int, extract: Callable[[str], str | None] = extract_answer):
        if n < 1:
            raise ValueError(f"MajorityVote: n must be >= 1, got {n}")
        self.inner, self.n, self.extract = inner, n, extract

    async def run(self, episode: Episode) -> Result:
        results = await _runs(self.inner, episode, self.n)
        answers = [self.extract(r.text) for r in results]
        return _choose(results, [answers.count(a) if a is not None else 0 for a in answers])


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its prompt template ({prompt}: the episode's, {previous}: the last stage's answer)."""

    template: str
    controller: Controller

    def render(self, prompt: str, previous: str) -> str:
        return self.template.format(prompt=prompt, previous=previous)


class Pipeline:
    """Stages in turn, each on the sequence so far plus its prompt's new tokens; one trajectory (module docstring)."""

    def __init__(self, stages: Sequence[Stage], tokenizer: Any):
        if not stages:
            raise ValueError("Pipeline: needs at least one stage")
        for i, stage in enumerate(stages):
            try:
                stage.render("", "")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"pipeline stage {i} template {stage.template!r} cannot be rendered ({type(e).__name__}: {e}); "
                    "it may name only {prompt} and {previous}; write a literal brace as {{ or }}"
                ) from e
        self.stages, self.tokenizer = tuple(stages), tokenizer

    async def run(self, episode: Episode) -> Result:
        path = _unsampled([])  # the chosen path so far, after the episode's prompt
        dead_ends: list[Sample] = []
        previous = ""
        for k, stage in enumerate(self.stages):
            rendered = stage.render(episode.prompt, previous)
            path = _join(path, _unsampled(self._new_ids(rendered, episode.prompt, path)))
            ids = episode.prompt_ids + tuple(path.output_ids)
            stage_episode = Episode(
                rendered, episode.answer, ids, derive_seed(episode.seed, "stage", k), episode.columns
            )
            result = await stage.controller.run(stage_episode)
            dead_ends += [_join(path, s) for s in result.samples if s is not result.chosen]
            path = _join(path, result.chosen)
            previous = result.text
        return Result(previous, path, (*dead_ends, path))

    def _new_ids(self, rendered: str, prompt: str, path: Sample) -> list[int]:
        """The tokens of what ``rendered`` adds to the sequence: the rest of it when it extends the sequence's text."""
        so_far = prompt + self.tokenizer.decode(path.output_ids, skip_special_tokens=True)
        new = rendered.removeprefix(so_far)
        return self.tokenizer(new, add_special_tokens=False)["input_ids"] if new else []


async def _runs(inner: Controller, episode: Episode, n: int) -> list[Result]:
    runs = (inner.run(replace(episode, seed=derive_seed(episode.seed, "run", i))) for i in range(n))
    return list(await asyncio.gather(*runs))


def _choose(results: list[Result], scores: list[float | None]) -> Result:
    """The run with the highest score, the first of equals; a None score ranks below every number."""
    ranked = [-math.inf if s is None else s for s in scores]
    best = results[ranked.index(max(ranked))]
    return Result(best.text, best.chosen, tuple(s for r in results for s in r.samples), tuple(scores))


def _unsampled(ids: list[int]) -> Sample:
    """Tokens put into a trajectory that the model did not sample: not trained on, no version."""
    return Sample(list(ids), [0.0] * len(ids), [-1] * len(ids), "stop", loss_mask=[0] * len(ids), turns=0)


def _join(head: Sample, tail: Sample) -> Sample:
    """``head``'s tokens then ``tail``'s, as one trajectory that ends (finish reason, text) as ``tail`` does."""
    return Sample(
        head.output_ids + tail.output_ids,
        joined_logprobs(head.logprobs, tail.logprobs),
        head.versions + tail.versions,
        tail.finish_reason,
        tail.text,
        loss_mask=head.mask() + tail.mask(),
        turns=head.turns + tail.turns,
    )


def make_controller(w: WorkflowConfig, generate: Controller, tokenizer: Any, verifier: Rewarder) -> Controller:
    """The controller ``workflow.name`` names, built on ``generate``."""
    if w.name == "best_of_n":
        return BestOfN(generate, w.n, verifier)
    if w.name == "majority_vote":
        return MajorityVote(generate, w.n, extract_answer)
    if w.name == "pipeline":
        return Pipeline([Stage(template, generate) for template in w.stages], tokenizer)
    raise ValueError(f"workflow.name={w.name!r} is not a scaffold: expected best_of_n, majority_vote or pipeline")


def runs_per_group(w: WorkflowConfig, group_size: int) -> int:
    """Controller runs that give one episode's ``algorithm.group_size`` trajectories; ValueError if none do."""
    per_run = w.n if w.train_on == "all" and w.name in ("best_of_n", "majority_vote") else 1
    if group_size % per_run:
        raise ValueError(
            f"workflow.train_on=all trains on all workflow.n={per_run} candidates of each {w.name} run, so "
            f"algorithm.group_size={group_size} (samples per prompt) must be a multiple of {per_run}; change "
            "one of them, or set workflow.train_on=chosen"
        )
    return group_size // per_run


class ScaffoldWorkflow:
    """A controller as a rollout workflow: ``runs`` runs of it make one episode's ``Group``.

    It owns the verifier's reward pool, when it has one of its own: ``close()``, or at the latest when the
    workflow is collected or the interpreter exits, ends its processes.
    """

    def __init__(
        self,
        controller: Controller,
        tokenizer: Any,
        rewards: Rewarder,
        runs: int,
        train_on: str,
        pools: Sequence[RewardPool] = (),
    ):
        if train_on not in ("all", "chosen"):
            raise ValueError(f"workflow.train_on={train_on!r} is invalid: expected all or chosen")
        self.controller, self.tokenizer, self.rewards = controller, tokenizer, rewards
        self.runs, self.train_on = runs, train_on
        self._close = weakref.finalize(self, _close_pools, list(pools))

    async def run(
        self, prompt: str, answer: str, seed: int | None = None, columns: Mapping[str, Any] | None = None
    ) -> Group:
        episode = Episode.of(prompt, answer, self.tokenizer, seed, columns)
        results = await _runs(self.controller, episode, self.runs)
        chosen = self.train_on == "chosen"
        samples = [r.chosen for r in results] if chosen else [s for r in results for s in r.samples]
        outcomes = await self.rewards.score([episode.scored(s.text) for s in samples])
        for sample, outcome in zip(samples, outcomes, strict=True):
            sample.reward, sample.reward_error, sample.reward_parts = outcome.value, outcome.error, outcome.parts
        return Group(prompt, answer, list(episode.prompt_ids), samples)

    def close(self) -> None:
        self._close()


def _close_pools(pools: list[RewardPool]) -> None:
    for pool in pools:
        pool.close()


def scaffold_workflow(
    cfg: Config,
    client: InferenceClient,
    tokenizer: Any,
    sampling: dict[str, Any],
    rewards: Rewarder,
    resumed: asyncio.Event,
) -> ScaffoldWorkflow:
    """The scaffold ``cfg.workflow`` describes; best-of-N's verifier is ``workflow.verifier`` or the task reward."""
    w = cfg.workflow
    runs = runs_per_group(w, cfg.algorithm.group_size)
    pools = []
    verifier = rewards
    if w.name == "best_of_n" and w.verifier and w.verifier != cfg.reward.fn:
        # imported in processes of its own, like a reward: the same registry, timeout and isolation
        if isinstance(rewards, RewardPool):  # its settings and reward-model servers
            pools.append(rewards.sibling(w.verifier))
        else:
            pools.append(RewardPool(w.verifier, cfg.reward.workers, cfg.reward.timeout_s).start())
        verifier = pools[0]
    generate = Generate(client, tokenizer, sampling, resumed, cfg.rollout.max_empty_aborts, behaviour_logprobs(cfg))
    controller = make_controller(w, generate, tokenizer, verifier)
    return ScaffoldWorkflow(controller, tokenizer, rewards, runs, w.train_on, pools)
