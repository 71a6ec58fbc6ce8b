"""A plug-in episode function as a workflow: ``algorithm.group_size`` runs of it per row, through the proxy.

    workflow = AgentWorkflow(episode, client, tokenizer, chat, sampling, group_size, rewards, resumed, ...)
    group = await workflow.run(prompt, answer, seed)     # the trajectories of group_size runs
    accuracy = await workflow.accuracy(rows)             # held-out: one greedy run per row, its final reward
    await workflow.aclose()

Each run gets an endpoint of its own on the process's proxy (``hpcrl/rollout/proxy``) and an
``openai.AsyncOpenAI`` client on it, calls the episode
function (``base.py``'s contract), and turns what the proxy recorded into trajectories: rewards propagated back
with ``workflow.turn_discount``, turns joined where a prompt extends the trajectory so far token for token
(``proxy/trajectories.py``). The group holds every trajectory of every run; a run whose turns all join gives
one, so a group has ``group_size`` samples, more when some conversation did not join (its parts are trained
as separate samples, each with its own reward). The group's ``prompt_ids`` are the tokens all its trajectories
start with; each sample holds the rest, its own prompt tokens masked.

Clients: building an ``openai`` client with a connection pool of its own costs ~50 ms (an SSL context), so a
run's clients share ``POOLS`` pools, taken in turn. Not one: httpx scans every connection of a pool for each
request, which with hundreds of episodes at once cost more CPU than the episodes. Connections are kept without
expiry: with httpx's 5 s expiry, a connection expiring as a request took it was closed under that request (a
ReadError) when episodes started again after a train step; the proxy keeps idle connections an hour, and one
it closed is seen as closed before it is used. Plain HTTP on loopback: no SSL context is built.

Failures: a reward that failed (``ep.score`` raised, or the episode left a completion without a reward) marks
that run's samples failed, for ``reward.on_error``. An episode that raised after the proxy answered it with an
inference error raises that error (its group is dropped and counted, ``too_long`` or ``failed``); any other
exception is a bug of the episode and fails the run with its traceback, as a built-in workflow's would; so does
an episode that made no request at all.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from hpcrl.inference.client import InferenceClient
from hpcrl.inference.openai.chat import ChatFormat
from hpcrl.net import PortAllocator
from hpcrl.reward.registry import to_reward
from hpcrl.rollout.proxy.records import EpisodeLog
from hpcrl.rollout.proxy.server import MODEL, Proxy
from hpcrl.rollout.proxy.trajectories import MissingReward, join, propagate_rewards, shared_prompt, to_sample
from hpcrl.rollout.workflows.base import EpisodeContext, EpisodeFn, Group, Rewarder, behaviour_logprobs, derive_seed
from hpcrl.rollout.workflows.single_turn import MAX_EMPTY_ABORTS

logger = logging.getLogger(__name__)  # (``log`` names an episode's EpisodeLog here)

CLIENT_TIMEOUT_S = 3600.0  # the agent's client's deadline per request: a backstop (the proxy's requests have theirs)
POOLS = 16  # connection pools the episodes' clients are spread over (module docstring)


class RewardFailed(RuntimeError):
    """``ep.score`` could not score: the reward function raised or timed out (its message says which)."""


class EpisodeFailed(RuntimeError):
    """An episode broke the contract (it made no request); the run fails naming the workflow."""


class AgentWorkflow:
    """``algorithm.group_size`` runs of ``episode`` per row (module docstring); one object serves every episode."""

    def __init__(
        self,
        episode: EpisodeFn,
        client: InferenceClient,
        tokenizer: Any,
        chat: ChatFormat,
        sampling: dict[str, Any],  # the rollout's, SGLang's names (sampling_params)
        group_size: int,
        rewards: Rewarder,  # reward.fn, for ep.score
        resumed: asyncio.Event,
        *,
        turn_discount: float = 1.0,  # the reward's factor per completion back from one that has it
        host: str = "127.0.0.1",  # the proxy's loopback address
        ports: PortAllocator | None = None,  # the proxy's port slice
        name: str = "",  # workflow.name, for errors
        max_empty_aborts: int = MAX_EMPTY_ABORTS,  # the proxy's: a choice's aborted answers in a row with no token
        logprobs: bool = True,  # the proxy records the servers' logprobs; False: it asks for none the agent did not
    ):
        if not 0 < turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        self.episode, self.client, self.tokenizer, self.chat = episode, client, tokenizer, chat
        self.sampling, self.group_size, self.rewards, self.resumed = dict(sampling), group_size, rewards, resumed
        self.turn_discount, self.host, self.ports, self.name = turn_discount, host, ports, name
        self.max_empty_aborts, self.logprobs = max_empty_aborts, logprobs
        self._proxy: Proxy | None = None
        self._pools: list[Any] = []  # httpx clients the episodes' openai clients share (module docstring)
        self._next_pool = 0
        self._starting = asyncio.Lock()

    async def run(
        self, prompt: str, answer: str, seed: int | None = None, columns: Mapping[str, Any] | None = None
    ) -> Group:
        proxy = await self._started()
        row = {"prompt": prompt, "answer": answer, "columns": dict(columns or {})}
        seeds = [derive_seed(seed, "sample", i) for i in range(self.group_size)]
        runs = await asyncio.gather(*(self._episode(proxy, row, i, s, self.sampling) for i, s in enumerate(seeds)))
        return _group(row, runs)

    async def accuracy(self, rows: Sequence[dict[str, Any]]) -> float:
        """Mean final reward of one greedy run per row (a failed reward counts 0): the agent's held-out accuracy."""
        proxy = await self._started()
        greedy = {**self.sampling, "temperature": 0.0}
        row_of = [{"prompt": r["prompt"], "answer": r["answer"], "columns": r.get("columns", {})} for r in rows]
        runs = await asyncio.gather(*(self._episode(proxy, row, 0, None, greedy) for row in row_of))
        return statistics.fmean(
            (log.completions[-1].reward or 0.0) if error is None else 0.0 for log, error in runs
        ) if runs else 0.0  # fmt: skip

    async def aclose(self) -> None:
        if self._proxy is not None:
            await self._proxy.close()
            self._proxy = None
        for pool in self._pools:
            await pool.aclose()
        self._pools = []

    async def _started(self) -> Proxy:
        async with self._starting:
            if self._proxy is None:
                import openai  # here: importing it takes a second, which a run without agents never pays

                proxy = Proxy(
                    self.client, self.tokenizer, self.chat, self.resumed,
                    host=self.host, ports=self.ports, max_empty_aborts=self.max_empty_aborts, logprobs=self.logprobs,
                )  # fmt: skip
                await proxy.start()
                limits = _pool_limits(openai)
                self._pools = [
                    openai.DefaultAsyncHttpxClient(timeout=CLIENT_TIMEOUT_S, limits=limits, verify=False)
                    for _ in range(POOLS)
                ]
                self._proxy = proxy
            return self._proxy

    async def _episode(
        self, proxy: Proxy, row: dict[str, Any], index: int, seed: int | None, sampling: dict[str, Any]
    ) -> tuple[EpisodeLog, str | None]:
        """One run: its log, and why its reward failed (None: every completion has one)."""
        import openai

        log = proxy.open(sampling, seed)
        base_url = proxy.base_url(log)
        self._next_pool = (self._next_pool + 1) % len(self._pools)
        pool = self._pools[self._next_pool]
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=log.key, http_client=pool, max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        ctx = EpisodeContext(
            row=dict(row),
            client=client,
            base_url=base_url,
            sampling=openai_sampling(sampling),
            index=index,
            seed=seed,
            set_reward=log.set_reward,
            score=lambda text: self._score(row, text),
            model=MODEL,
        )
        try:
            final = await self.episode(ctx)
            error = None
        except RewardFailed as e:
            final, error = None, str(e)
        except Exception as e:
            if log.error is not None:  # the agent gave up on an answer the proxy could not give: the cause is that
                raise log.error from e
            raise
        finally:
            proxy.close_episode(log)
        if not log.completions:
            raise EpisodeFailed(f"workflow.name={self.name!r}: the episode made no request through its client")
        if error is None:
            error = _rewards(log, final, self.turn_discount)
        return log, error

    async def _score(self, row: dict[str, Any], text: str) -> float:
        if not isinstance(text, str):
            raise TypeError(f"ep.score takes the completion's text (a str), got {type(text).__name__}")
        [outcome] = await self.rewards.score([(row["prompt"], text, row["answer"], row.get("columns") or {})])
        if outcome.error is not None:
            raise RewardFailed(outcome.error)
        return outcome.value


def _pool_limits(openai: Any) -> Any:
    """A pool's limits: openai's, with connections kept without expiry (module docstring)."""
    limits = openai.DEFAULT_CONNECTION_LIMITS
    return type(limits)(max_connections=limits.max_connections, max_keepalive_connections=None, keepalive_expiry=None)


def openai_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """The rollout's sampling parameters under OpenAI's names, as an episode passes them to its client."""
    out = {"temperature": sampling.get("temperature"), "top_p": sampling.get("top_p")}
    out["max_tokens"] = sampling.get("max_new_tokens")
    if sampling.get("stop"):
        out["stop"] = list(sampling["stop"])
    return {k: v for k, v in out.items() if v is not None}


def _rewards(log: EpisodeLog, final: Any, discount: float) -> str | None:
    """Propagate the run's rewards (in place); why they fail, or None."""
    try:
        value = None if final is None else to_reward(final)
    except (TypeError, ValueError) as e:
        return f"the episode {e}"
    try:
        propagate_rewards(log.completions, value, discount)
    except MissingReward as e:
        return str(e)
    return None


def _group(row: dict[str, Any], runs: Sequence[tuple[EpisodeLog, str | None]]) -> Group:
    per_run = [(join(log.completions), error) for log, error in runs]
    trajectories = [t for ts, _ in per_run for t in ts]
    prompt = shared_prompt(trajectories)
    samples = [to_sample(t, len(prompt), error) for ts, error in per_run for t in ts]
    completions = sum(len(log.completions) for log, _ in runs)
    counts = {
        "agent_completions": completions,
        "agent_turns_joined": completions - len(trajectories),  # turns that extended an earlier trajectory
        "agent_trajectories": len(trajectories),  # group_size when every conversation joined; more when not
        "agent_tool_calls": sum(c.tool_calls for log, _ in runs for c in log.completions),
    }
    return Group(row["prompt"], row["answer"], prompt, samples, counts)


def agent_workflow(
    cfg: Any,
    client: InferenceClient,
    tokenizer: Any,
    sampling: dict[str, Any],
    rewards: Rewarder,
    resumed: asyncio.Event,
    *,
    host: str = "127.0.0.1",
    ports: PortAllocator | None = None,
) -> AgentWorkflow:
    """The plug-in ``cfg.workflow.name`` names, as a workflow (``make_workflow``'s part for plug-ins)."""
    from hpcrl.rollout.workflows.plugin import resolve

    w = cfg.workflow
    if not isinstance(cfg.reward.fn, str):
        logger.warning(
            "reward.fn is a list: a plug-in episode's reward is what ep.score returns (their weighted sum) or what it "
            "sets, so its parts are not logged as reward/<name>"
        )
    chat = ChatFormat(tokenizer, w.chat_template, w.tool_parser)
    return AgentWorkflow(
        resolve(w.name), client, tokenizer, chat, sampling, cfg.algorithm.group_size, rewards, resumed,
        turn_discount=w.turn_discount, host=host, ports=ports, name=w.name,
        max_empty_aborts=cfg.rollout.max_empty_aborts, logprobs=behaviour_logprobs(cfg),
    )  # fmt: skip
