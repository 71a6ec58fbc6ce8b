"""The async client of the reward-model servers (``allocation.reward_model``), and what a model reward is handed.

    client = RewardModelClient(["node3:30010", "node4:30010"], timeout_s=10.0)
    verdicts = await asyncio.gather(*(client.generate(t, max_new_tokens=4, temperature=0.0) for t in texts))
    scores = await asyncio.gather(*(client.classify(t) for t in texts))   # a discriminative reward model
    await client.close()

Calls issued in the same event-loop tick (a group's completions scored with ``asyncio.gather``) are coalesced into
ONE batched request per route and settings: the first call of a batch schedules its send with ``call_soon``, so
every call made before the loop turns joins it, and the batch goes as one POST with a ``text`` list. Batches go to
the servers round-robin. The bodies are SGLang 0.5.23's (``hpcrl/inference/server/classify.py`` and
``../shared/reference``): ``POST /generate`` ``{"text": [...], "sampling_params": {"max_new_tokens", "temperature"}}``
answered with one ``{"text", "output_ids", "meta_info"}`` per prompt; ``POST /classify`` ``{"text": [...]}``
(``EmbeddingReqInput``) answered with one ``{"embedding": [score], "meta_info"}`` per prompt.

The wire is ``client_http.HttpPool``'s (the policy servers' client): connection failures and HTTP 5xx are retried
(on another server when there is one), a 4xx is not, and what fails raises ``InferenceError`` naming the server, the
route and what the server said. Each batch also has a deadline of ``timeout_s`` (``reward.timeout_s``) from the
moment it is sent, whatever the retries: past it, ``InferenceError`` naming the server it was waiting on.

``wait_s`` is the time spent waiting on the reward model: seconds, cumulative, during which at least one batch
was in flight (concurrent batches count once), for the step's timeline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hpcrl.inference.client_http import HttpPool, InferenceError

__all__ = ["InferenceError", "RewardModel", "RewardModelClient"]

log = logging.getLogger(__name__)

GENERATE, CLASSIFY = "/generate", "/classify"
_MARGIN_S = 1.0  # the HTTP layer's own deadline comes this much later, so the batch's deadline is what fires
_Key = tuple[str, tuple[tuple[str, Any], ...]]  # (route, sampling settings): calls that can share one request


@dataclass
class _Call:
    text: str
    future: asyncio.Future


class RewardModelClient:
    """Batched, round-robin requests to the reward-model servers; made and used in one running event loop."""

    def __init__(self, addresses: Sequence[str], timeout_s: float, max_retries: int = 1, backoff_s: float = 0.2):
        if not addresses:
            raise ValueError("RewardModelClient: no reward-model server addresses; expected host:port, ...")
        if not timeout_s > 0:
            raise ValueError(f"RewardModelClient: timeout_s must be seconds > 0, got {timeout_s!r}")
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.requests = 0  # batched HTTP requests sent
        self.prompts = 0  # texts sent in them
        self._http = HttpPool(
            self.addresses,
            timeout_s=timeout_s + _MARGIN_S,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_connections=64,
        )
        self._cycle = itertools.cycle(self.addresses)
        self._pending: dict[_Key, list[_Call]] = {}
        self._sending: set[asyncio.Task] = set()
        self._opened = False
        self._in_flight = 0
        self._busy_since = 0.0
        self._waited_s = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it was first used in

    @property
    def wait_s(self) -> float:
        """Seconds, cumulative, during which a request to the reward model was in flight (the module docstring)."""
        ongoing = time.monotonic() - self._busy_since if self._in_flight else 0.0
        return self._waited_s + ongoing

    async def generate(self, text: str, max_new_tokens: int, temperature: float) -> str:
        """The reward model's answer to ``text`` (``/generate``), batched with the calls of the same tick."""
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"RewardModelClient: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        settings = (("max_new_tokens", max_new_tokens), ("temperature", float(temperature)))
        return await self._issue((GENERATE, settings), text)

    async def classify(self, text: str) -> float:
        """The reward model's score of ``text`` (``/classify``), batched with the calls of the same tick."""
        return await self._issue((CLASSIFY, ()), text)

    async def close(self) -> None:
        """Close the HTTP session (calls still queued fail)."""
        for calls in self._pending.values():
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(RuntimeError("the reward-model client was closed"))
        self._pending.clear()
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
        await self._http.close()

    # ---- batching

    async def _issue(self, key: _Key, text: str) -> Any:
        if not isinstance(text, str):
            raise TypeError(f"RewardModelClient: the text must be a str, got {type(text).__name__}")
        loop = asyncio.get_running_loop()
        if self.loop is None:
            self.loop = loop
        elif self.loop is not loop:
            raise RuntimeError("RewardModelClient is bound to the event loop it was first used in; make one per loop")
        calls = self._pending.get(key)
        if calls is None:
            calls = self._pending[key] = []
            loop.call_soon(self._flush, key)  # after every call already scheduled in this tick has joined
        call = _Call(text, loop.create_future())
        calls.append(call)
        return await call.future

    def _flush(self, key: _Key) -> None:
        calls = self._pending.pop(key, [])
        if calls:
            task = asyncio.get_running_loop().create_task(self._send(key, calls))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, key: _Key, calls: list[_Call]) -> None:
        route, settings = key
        body: dict[str, Any] = {"text": [c.text for c in calls]}
        if route == GENERATE:
            body["sampling_params"] = dict(settings)
        try:
            answers = await self._post(route, body)
        except BaseException as error:
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for call, answer in zip(calls, answers, strict=True):
            if not call.future.done():
                call.future.set_result(answer)

    # ---- the wire

    async def _post(self, route: str, body: dict[str, Any]) -> list[Any]:
        if not self._opened:
            await self._http.open()
            self._opened = True
        chosen: list[str] = []
        self._started()
        try:
            async with asyncio.timeout(self.timeout_s):
                server, answer = await self._http.call(self._choose(chosen), "POST", route, body)
        except TimeoutError:
            server = chosen[-1] if chosen else "?"
            raise InferenceError(
                f"POST {route} on reward-model server {server}: no answer to a batch of {len(body['text'])} within "
                f"reward.timeout_s={self.timeout_s:g} s; the server is hung or overloaded (its log), or the judge "
                "needs a longer reward.timeout_s",
                server=server,
                endpoint=route,
            ) from None
        finally:
            self._ended()
        self.requests += 1
        self.prompts += len(body["text"])
        return _read(route, server, answer, len(body["text"]))

    def _choose(self, chosen: list[str]) -> Callable[[list[str]], Awaitable[str]]:
        """Round-robin over the servers, skipping those that already failed this request while others remain."""

        async def choose(tried: list[str]) -> str:
            for _ in self.addresses:
                server = next(self._cycle)
                if server not in tried:
                    break
            chosen.append(server)
            return server

        return choose

    def _started(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.monotonic()
        self._in_flight += 1

    def _ended(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._waited_s += time.monotonic() - self._busy_since


def _read(route: str, server: str, answer: Any, count: int) -> list[Any]:
    """Each prompt's answer: its text (``/generate``) or its one score (``/classify``)."""
    try:
        if not isinstance(answer, list) or len(answer) != count:
            raise ValueError(f"expected a list of {count} answers")
        if route == GENERATE:
            texts = [a["text"] for a in answer]
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("a text is not a string")
            return texts
        scores = [a["embedding"] for a in answer]
        if not all(isinstance(s, list) and len(s) == 1 for s in scores):
            raise ValueError("expected one score per prompt (a reward model with a one-label head)")
        return [float(s[0]) for s in scores]
    except (KeyError, TypeError, ValueError) as error:
        raise InferenceError(
            f"POST {route} on reward-model server {server} answered {str(answer)[:300]}: {error}",
            server=server,
            endpoint=route,
        ) from error


@dataclass
class RewardModel:
    """What a model reward gets as its ``reward_model`` argument: the client of the reward-model servers, with the
    run's ``reward.judge`` settings (a ``JudgeConfig``) and ``reward.model.kind``."""

    client: RewardModelClient
    judge: Any  # reward.judge: template, template_file, pattern, max_new_tokens, temperature
    kind: str = "generative"  # reward.model.kind: generative | discriminative

    async def generate(self, text: str, max_new_tokens: int | None = None, temperature: float | None = None) -> str:
        """The judge's answer to ``text``; sampling settings default to reward.judge's."""
        new_tokens = self.judge.max_new_tokens if max_new_tokens is None else max_new_tokens
        temp = self.judge.temperature if temperature is None else temperature
        return await self.client.generate(text, new_tokens, temp)

    async def classify(self, text: str) -> float:
        """The reward model's score of ``text`` (a discriminative reward model)."""
        return await self.client.classify(text)
