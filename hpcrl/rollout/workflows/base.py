"""What every workflow shares: a trajectory (``Sample``), an episode's result (``Group``), the
``Workflow`` and ``Rewarder`` interfaces, the episode contract of plug-ins (``EpisodeContext``), and the
sampling parameters every rollout request sends.

Every generated token carries the weight version of the server that produced it (``version_number``), and its
logprob as the server sampled it; built with ``logprobs=False`` (``algorithm.behaviour_logprobs=recompute``,
``behaviour_logprobs``) a workflow asks the servers for none (SGLang then computes none) and its samples carry
``logprobs=None``.

The episode contract. ``workflow.name=module:function`` names an async function that runs one episode of one
sample against an OpenAI-compatible endpoint; ``module:Class`` a class built once per process (no arguments)
whose instances are such functions (``async def __call__``)::

    async def my_agent(ep: EpisodeContext) -> float | None:
        reply = await ep.client.chat.completions.create(model=ep.model, messages=[...], tools=[...])
        ...
        return await ep.score(reply.choices[0].message.content)    # the reward of the last completion

It receives the row, an ``openai.AsyncOpenAI`` client (and the base URL it is built on), the rollout's sampling
parameters, its index in the group and its seed; it returns the reward of its last completion, or None when it
gave rewards with ``ep.set_reward(response.id, r)``. Its episodes run concurrently, like every workflow's.
hpcrl turns it into a ``Workflow`` (``agent.py``): ``algorithm.group_size`` calls per row, each through an
endpoint of its own that records every completion token for token (``hpcrl/rollout/proxy``). The built-in
workflows implement ``Workflow`` themselves, at the token level; everything about an episode travels in its
arguments there too, never in the workflow object.

Seeds: an episode may get a seed (the controller derives one from ``run.seed`` and the row's draw number);
every request it sends then carries SGLang's ``sampling_params.sampling_seed``, derived from it and where the
request is in the episode (``derive_seed``: the sample's index, the turn, the tokens already generated), so
the same seed and the same weights give the same samples.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from hpcrl.seeds import derive_seed as derive_seed  # the workflows and the controller import it from here


class Rewarder(Protocol):
    """``reward.fn`` (a ``RewardPool``): one ``RewardOutcome`` per ``(prompt, completion, answer, columns)`` item,
    ``columns`` being the row's columns the reward functions take by name (``hpcrl.reward.registry``)."""

    async def score(self, items: list[tuple[str, str, str, Mapping[str, Any]]]) -> list[Any]: ...


@dataclass
class Sample:
    """One trajectory after the prompt: the model's tokens and, in multi-turn or pipeline workflows, the
    tokens put between its turns (feedback, a stage's instructions), which are not trained on."""

    output_ids: list[int]
    # of each output token, as the server sampled it (tempered); 0.0 for tokens not sampled; None when the servers
    # were asked for none (algorithm.behaviour_logprobs=recompute: the trainers compute them)
    logprobs: list[float] | None
    versions: list[int]  # weight version that produced each output token; -1 for tokens not sampled
    finish_reason: str
    text: str = ""  # what the reward reads (the model's final answer in a multi-turn trajectory)
    reward: float | None = None
    reward_error: str | None = None
    loss_mask: list[int] | None = None  # 1 for each token the model sampled; None: every output token is
    turns: int = 1  # model turns in the trajectory
    reward_parts: dict[str, float] | None = None  # reward.fn as a list: each function's own value, by its name

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
    counts: dict[str, int] = field(default_factory=dict)  # what the workflow counted (metrics sum them per step)

    def min_version(self) -> int:
        return min((v for s in self.samples for v in s.versions), default=0)


class Workflow(Protocol):
    """One episode: a prompt and its reference answer in (and the row's columns the reward functions take, passed
    on with every completion they score), a scored ``Group`` out.

    Episodes run concurrently on one workflow object: an episode's state lives in its own call (its
    arguments and locals), never in attributes of the workflow.
    """

    async def run(
        self, prompt: str, answer: str, seed: int | None = None, columns: Mapping[str, Any] | None = None
    ) -> Group: ...


@dataclass
class EpisodeContext:
    """What one plug-in episode gets (module docstring): one sample of one row."""

    row: dict[str, Any]  # the dataset row: "prompt" (as the dataset made it), "answer", "columns" (the rewards')
    client: Any  # openai.AsyncOpenAI on this episode's endpoint (its own base URL; retries are hpcrl's)
    base_url: str  # that endpoint, for frameworks that build a client of their own (any API key works)
    sampling: dict[str, Any]  # the rollout's, by OpenAI's names: temperature, top_p, max_tokens, stop
    index: int  # this sample's place in its group, 0 .. algorithm.group_size - 1
    seed: int | None  # this sample's seed (requests' sampling seeds derive from it); None: unseeded
    set_reward: Callable[..., None]  # set_reward(response_id, reward[, index]): a completion's reward
    score: Callable[[str], Awaitable[float]]  # the task's reward (reward.fn) of a completion's text
    model: str = "hpcrl-policy"  # the model's name; the endpoint takes any

    @property
    def prompt(self) -> str:
        return self.row["prompt"]

    @property
    def answer(self) -> str:
        return self.row["answer"]


EpisodeFn = Callable[[EpisodeContext], Awaitable[float | None]]


def behaviour_logprobs(cfg: Any) -> bool:
    """Whether rollout asks the servers for the sampled tokens' logprobs: not when the trainers recompute them."""
    return cfg.algorithm.behaviour_logprobs != "recompute"


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


def joined_logprobs(*runs: list[float] | None) -> list[float] | None:
    """The logprobs of consecutive runs of tokens as one list; None when any run has none (its server was asked for
    none), so a trajectory never carries logprobs for only some of its sampled tokens."""
    if any(run is None for run in runs):
        return None
    return [lp for run in runs for lp in run]  # type: ignore[union-attr]


def version_number(weight_version: Any) -> int:
    """SGLang reports weight versions as strings; before any update it says "default" (version 0)."""
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        return 0
