"""The per-episode OpenAI endpoint: a small HTTP server in each process that runs episodes.

    proxy = Proxy(client, tokenizer, chat, resumed, host="127.0.0.1", ports=allocator)
    await proxy.start()
    log = proxy.open(sampling, seed)        # an episode: its base URL is proxy.base_url(log)
    ...  the agent's openai client posts to <base URL>/chat/completions, /completions; GET /models ...
    proxy.close_episode(log)                # log.completions: every answer, token for token
    await proxy.close()

Each episode has its own base URL, ``http://<loopback>:<port>/e/<key>/v1``, whose key is 128 random bits: an
episode's requests reach its own record and no other's. A request is checked as SGLang's OpenAI routes check it
(``hpcrl/inference/openai/protocol.py``, the same 400s), its messages rendered with the chat template (and its
tools) to token ids, and each of its ``n`` choices generated from those ids by hpcrl's ``InferenceClient``,
through ``SingleTurn.sample``: a weight update's abort is waited out and the choice goes on from where it
stopped, and a server that aborts every request fails it after ``max_empty_aborts`` tries with no new token
(``NoProgress``, an inference error: a 502 below). The answer's text is decoded from the generated ids, its
tool calls parsed from that text; what is recorded for training is the ids, never the text (``records.py``).
Each choice asks the servers for its tokens' logprobs, which are recorded with them; built with ``logprobs=False``
(``algorithm.behaviour_logprobs=recompute``) it asks only when the agent's request does (OpenAI's ``logprobs``),
and records none.

The episode's sampling parameters are the rollout's: a request that leaves one unset gets the episode's; a
``temperature`` other than the episode's is refused (the trainer computes logprobs at ``rollout.temperature``,
and a sample drawn at another would train with the wrong ratio), and so is a ``top_p`` below 1 or a ``top_k`` in a
training episode (the trainer's ratio is of the full distribution, not the truncated one sampled from; held-out
evaluation is greedy, where they change nothing). ``max_tokens``, ``stop``, ``seed`` and ``n`` are the agent's to
choose.

Who can reach it: the proxy binds the loopback address only (127.0.0.1, or ::1 for an IPv6 run), on a port of
its process's own slice of the port range, so only processes on the same host can connect, and an episode's
URL is known only to that episode. The run's secret is never handed to agent code, which may pass its API key
to tools or subprocesses; the API key is not checked (docs/agents.md says why).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a 400 for a request that cannot
be honoured, ``context_length_exceeded`` for a prompt that does not fit the model's context, a 502 when the
inference servers failed it through the client's retries; the last two are kept on the episode's log, so the
episode's failure is counted by its cause (``too_long``, ``failed``) whatever the agent makes of the answer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import secrets
from typing import Any

from aiohttp import web

from hpcrl.inference.client import ContextLengthError, InferenceClient, InferenceError
from hpcrl.inference.openai.chat import ChatFormat, decode_answer
from hpcrl.inference.openai.errors import OpenAIError
from hpcrl.inference.openai.protocol import (
    Choice,
    Sampling,
    chat_response,
    completion_response,
    models_response,
    new_id,
    parse_chat,
    parse_completion,
)
from hpcrl.net import PortAllocator, family_of, format_hostport
from hpcrl.rollout.proxy.records import Completion, EpisodeLog
from hpcrl.rollout.workflows.single_turn import MAX_EMPTY_ABORTS, SingleTurn

log = logging.getLogger(__name__)

MODEL = "hpcrl-policy"  # the model's name on /v1/models; a request may name any model
MAX_BODY_BYTES = 16 << 20
BIND_TRIES = 8  # ports of the slice tried in turn when another process took one between probe and bind
KEEPALIVE_S = 3600.0  # idle connections are kept this long (the agents' pool keeps them without expiry)


def loopback(advertised_host: str) -> str:
    """The loopback address of ``advertised_host``'s family: where a proxy for that run listens."""
    return "::1" if family_of(advertised_host) == "ipv6" else "127.0.0.1"


# one line per request at INFO from the agents' HTTP clients would drown the run's log
for _name in ("httpx", "httpx2"):
    logging.getLogger(_name).setLevel(logging.WARNING)


class Proxy:
    """One per process that runs episodes; every episode of the process has its own URL on it."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        chat: ChatFormat,
        resumed: asyncio.Event,  # set while generation runs; cleared during a weight update
        *,
        host: str = "127.0.0.1",  # the loopback address of the run's family
        ports: PortAllocator | None = None,  # this process's slice; None: any free port (tests)
        max_empty_aborts: int = MAX_EMPTY_ABORTS,  # a choice's aborted answers in a row with no token, unpaused
        logprobs: bool = True,  # record the servers' logprobs; False: ask for them only when the agent does
    ):
        self.client, self.tokenizer, self.chat, self.resumed = client, tokenizer, chat, resumed
        self.max_empty_aborts, self.logprobs = max_empty_aborts, logprobs
        self.host, self.ports = host, ports
        self.port = 0
        self.episodes: dict[str, EpisodeLog] = {}
        self._runner: web.AppRunner | None = None
        self._stop_ids = set(getattr(tokenizer, "all_special_ids", ()))

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.add_routes(
            [
                web.get("/e/{key}/v1/models", self._models),
                web.post("/e/{key}/v1/chat/completions", self._chat),
                web.post("/e/{key}/v1/completions", self._completions),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S)
        await self._runner.setup()
        for attempt in range(BIND_TRIES):
            port = self.ports.allocate(1)[0] if self.ports else 0
            site = web.TCPSite(self._runner, self.host, port, reuse_address=True)
            try:
                await site.start()
            except OSError as e:
                if e.errno != errno.EADDRINUSE or attempt == BIND_TRIES - 1:
                    await self._runner.cleanup()
                    raise
                continue
            self.port = port or self._runner.addresses[-1][1]
            break
        log.info("the episodes' OpenAI proxy listens on %s", format_hostport(self.host, self.port))

    async def close(self) -> None:
        for episode in list(self.episodes.values()):
            self.close_episode(episode)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, sampling: dict[str, Any], seed: int | None = None) -> EpisodeLog:
        """A new episode with these default sampling parameters (SGLang's names) and seed."""
        episode = EpisodeLog(secrets.token_hex(16), dict(sampling), seed)
        self.episodes[episode.key] = episode
        return episode

    def base_url(self, episode: EpisodeLog) -> str:
        return f"http://{format_hostport(self.host, self.port)}/e/{episode.key}/v1"

    def close_episode(self, episode: EpisodeLog) -> None:
        """No more requests for the episode; requests still being served are cancelled."""
        episode.closed = True
        self.episodes.pop(episode.key, None)
        for task in episode.tasks:
            task.cancel()

    # --- the routes -----------------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        if self._episode(request) is None:
            return _not_found(request)
        return web.json_response(models_response(MODEL, self.client.context_length))

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, self._answer_chat)

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._serve(request, self._answer_completion)

    async def _serve(self, request: web.Request, answer) -> web.Response:
        episode = self._episode(request)
        if episode is None:
            return _not_found(request)
        try:
            if request.content_type != "application/json":
                raise OpenAIError(f"the body must be application/json, got {request.content_type!r}")
            try:
                body = await request.json()
            except ValueError as e:
                raise OpenAIError(f"the body is not valid JSON: {e}") from None
            # a task of its own, which closing the episode cancels (the handler's task serves the whole connection)
            work = asyncio.ensure_future(answer(episode, body))
            episode.tasks.add(work)
            try:
                return web.json_response(await work)
            except asyncio.CancelledError:
                work.cancel()
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]  # the client went away
                    raise
                return _error(410, "the episode ended while this request was served")
            finally:
                episode.tasks.discard(work)
        except OpenAIError as e:
            log.info("%s %s: %s", request.method, request.path, e)
            return _error(e.status, str(e), e.param, getattr(e, "code", None))

    async def _answer_chat(self, episode: EpisodeLog, body: Any) -> dict[str, Any]:
        req = parse_chat(body)
        self.chat.check_tools(req.tools, req.tool_choice)
        tools = req.tools if req.tool_choice != "none" else []
        prompt_ids = self.chat.prompt_ids(req.messages, tools)
        rid = new_id("chatcmpl-")
        choices, version = await self._generate(episode, rid, prompt_ids, req.sampling, tools, req.tool_choice)
        return chat_response(rid, req.model, choices, req.sampling.n, version)

    async def _answer_completion(self, episode: EpisodeLog, body: Any) -> dict[str, Any]:
        req = parse_completion(body)
        if len(req.prompts) != 1:
            raise OpenAIError("the proxy takes one prompt per request (send one request each)", param="prompt")
        (prompt,) = req.prompts
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt
        if not ids:
            raise OpenAIError("Prompt cannot be empty", param="prompt")
        # completions' own defaults (temperature 1, top_p 1, top_k -1) are not the episode's: unset them
        sampling = req.sampling
        body_keys = set(body)
        for name in ("temperature", "top_p", "top_k"):
            if name not in body_keys:
                setattr(sampling, name, None)
        if "max_tokens" not in body_keys:
            sampling.max_new_tokens = None
        rid = new_id("cmpl-")
        choices, version = await self._generate(episode, rid, list(ids), sampling, [], "none")
        return completion_response(rid, req.model, choices, sampling.n, version)

    # --- generation -----------------------------------------------------------------------------------------

    async def _generate(
        self, episode: EpisodeLog, rid: str, prompt_ids: list[int], sampling: Sampling, tools: list, tool_choice: str
    ) -> tuple[list[Choice], str]:
        """The request's ``n`` choices, each recorded on the episode; and the newest weight version among them."""
        if not sampling.stop and episode.sampling.get("stop"):  # the episode's, ending and trimmed as the request's
            sampling.stop = list(episode.sampling["stop"])
        params = self._params(episode, sampling)
        request = episode.requests
        episode.requests += 1
        single = SingleTurn(
            self.client, self.tokenizer, params, 1, None, self.resumed,  # type: ignore[arg-type]
            max_empty_aborts=self.max_empty_aborts, logprobs=self.logprobs or sampling.logprobs,
        )  # fmt: skip
        draws = [single.sample(prompt_ids, episode.request_seed(sampling.seed, request, k)) for k in range(sampling.n)]
        try:
            samples = await asyncio.gather(*draws)
        except ContextLengthError as e:
            episode.error = e
            raise _context_error(e) from e
        except InferenceError as e:
            episode.error = e
            raise OpenAIError(f"the inference servers failed the request: {e}", status=502) from e
        choices = []
        for k, sample in enumerate(samples):
            stop_ids = self._stop_ids | set(sampling.stop_token_ids)
            text, matched = decode_answer(self.tokenizer, sample.output_ids, sample.finish_reason, sampling, stop_ids)
            content, calls = self.chat.parse(text, tools, tool_choice)
            finish = "tool_calls" if calls and sample.finish_reason == "stop" else sample.finish_reason
            if not episode.closed:
                recorded = sample.logprobs if self.logprobs else None
                made = Completion(rid, k, 0, list(prompt_ids), sample.output_ids, recorded, sample.versions)
                made.finish_reason, made.text, made.tool_calls = finish, content, len(calls)
                episode.add(made)
            choices.append(
                Choice(
                    output_ids=sample.output_ids,
                    text=content,
                    finish_reason=finish,
                    matched_stop=None if calls else matched,
                    logprobs=sample.logprobs if sampling.logprobs else None,
                    tokens=[self.tokenizer.decode([t]) for t in sample.output_ids] if sampling.logprobs else None,
                    tool_calls=calls or None,
                    prompt_tokens=len(prompt_ids),
                )
            )
        versions = [v for s in samples for v in s.versions]
        return choices, str(max(versions)) if versions else "default"

    def _params(self, episode: EpisodeLog, sampling: Sampling) -> dict[str, Any]:
        """One choice's SGLang sampling parameters: the request's, the episode's where it sets none."""
        own = episode.sampling.get("temperature")
        if sampling.temperature is not None and own is not None and float(sampling.temperature) != float(own):
            raise OpenAIError(
                f"temperature={sampling.temperature} is not this episode's {own}: the trainer computes logprobs at "
                "rollout.temperature (held-out evaluation samples greedily, at 0); omit temperature or pass the "
                "episode's sampling['temperature']",
                param="temperature",
            )
        if own:  # a training episode (held-out evaluation is greedy: truncation changes nothing there)
            _refuse_truncation(sampling)
        return sampling.params({k: v for k, v in episode.sampling.items() if k != "stop"})

    def _episode(self, request: web.Request) -> EpisodeLog | None:
        return self.episodes.get(request.match_info["key"])


def _refuse_truncation(sampling: Sampling) -> None:
    """A training episode's request may not truncate the distribution it samples from: the server reports, and the
    trainer computes, the full distribution's logprobs, so the PPO ratio of a top-p or top-k sample is wrong."""
    for name, off in (("top_p", 1), ("top_k", -1)):
        value = getattr(sampling, name)
        if value is not None and value != off:
            raise OpenAIError(
                f"{name}={value} is refused in a training episode: the trainer's ratio is of the full distribution "
                f"(logprobs before truncation), not the truncated one sampled from; omit {name} or pass {off}",
                param=name,
            )


def _context_error(e: ContextLengthError) -> OpenAIError:
    error = OpenAIError(str(e), param="messages")
    error.code = "context_length_exceeded"  # type: ignore[attr-defined]
    return error


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
    return web.json_response(body, status=status)


def _not_found(request: web.Request) -> web.Response:
    return _error(404, f"no open episode at {request.path}: the episode ended, or this is not its URL")
