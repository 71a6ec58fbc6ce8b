"""The CPU server's HTTP routes: the subset of SGLang 0.5.23's API that hpcrl uses, as strictly as SGLang.

Generation, health, pause and the cache are here; the weight-update endpoints in ``weights.py``, the
OpenAI-compatible ones (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``) in
``openai_routes.py``. What SGLang does and this server does too (facts in ../shared/reference/sglang-http-api.md):

- ``/generate``: a prompt of the context length or longer, or prompt + ``max_new_tokens`` over it, is a
  400 with SGLang's message (``--allow-auto-truncate``: the prompt is cut, then ``max_new_tokens``);
- ``/health`` answers 200 only when a one-token generation comes back within ``HEALTH_TIMEOUT_S``, and
  503 while generation is paused (SGLang's health generation waits behind the pause, then gives up);
- ``/flush_cache`` is a 400 while requests run or wait (waiting ones are fine while paused), or after
  waiting ``?timeout=S`` for that;
- ``/abort_request`` aborts every request whose rid starts with ``rid``, or all with ``abort_all``; an
  empty rid without ``abort_all`` aborts nothing; the answer is an empty 200;
- ``/pause_generation`` and ``/continue_generation`` need a JSON body (``{}`` at least).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from aiohttp import web

from hpcrl.inference.context import fit
from hpcrl.inference.openai.chat import ChatFormat
from hpcrl.inference.server import requests
from hpcrl.inference.server.openai_routes import OpenAIRoutes
from hpcrl.inference.server.protocol import Prompt, parse_generate, response
from hpcrl.inference.server.requests import read_body
from hpcrl.inference.server.runner import ModelRunner
from hpcrl.inference.server.sampling import RequestError, SamplingParams
from hpcrl.inference.server.scheduler import Scheduler, Sequence
from hpcrl.inference.server.weights import WeightUpdates

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 << 20
HEALTH_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
HEALTH_RID_PREFIX = "HEALTH_CHECK"
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)
_FLUSH_POLL_S = 0.05


class Server:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        weights: WeightUpdates,
        context_length: int,
        allow_auto_truncate: bool = False,
        chat: ChatFormat | None = None,  # the OpenAI routes' chat template and tool-call parser
        served_model_name: str = "",  # the model's name on the OpenAI routes; "" = the model path, as SGLang's
    ):
        self.runner, self.scheduler, self.weights = runner, scheduler, weights
        self.context_length = context_length
        self.allow_auto_truncate = allow_auto_truncate
        self.openai = OpenAIRoutes(self, chat or ChatFormat(runner.tokenizer, tool_parser="none"), served_model_name)
        self.loop_task: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_as_json])
        get, post = web.get, web.post
        app.add_routes(
            [
                get("/health", self.health),
                get("/health_generate", self.health),
                get("/model_info", self.model_info),
                get("/get_model_info", self.model_info),
                post("/generate", self.generate),
                get("/flush_cache", self.flush_cache),
                post("/flush_cache", self.flush_cache),
                post("/pause_generation", self.pause),
                post("/continue_generation", self.resume),
                post("/abort_request", self.abort),
                *self.weights.routes(),
                *self.openai.routes(),
            ]
        )
        app.on_startup.append(self._start_loop)
        app.on_cleanup.append(self._stop_loop)
        return app

    async def _start_loop(self, _: web.Application) -> None:
        self.loop_task = asyncio.create_task(self.scheduler.run_forever(), name="scheduler")

    async def _stop_loop(self, _: web.Application) -> None:
        if self.loop_task:
            self.loop_task.cancel()
        self.weights.tp.close()

    async def health(self, _: web.Request) -> web.Response:
        """200 once a one-token generation came back; 503 while paused, or when it does not in time."""
        if self.loop_task is None or self.loop_task.done() or self.scheduler.pause_mode:
            return web.Response(status=503)
        rid = f"{HEALTH_RID_PREFIX}_{uuid.uuid4().hex}"
        probe = Sequence(
            rid, [0], SamplingParams(max_new_tokens=1, temperature=0), asyncio.get_running_loop().create_future()
        )
        try:
            await asyncio.wait_for(self.scheduler.generate([probe]), HEALTH_TIMEOUT_S)
        except TimeoutError:
            self.scheduler.abort(rid)
            log.error("health check failed: no generation within %g s", HEALTH_TIMEOUT_S)
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.runner.model_path,
                "tokenizer_path": self.runner.model_path,
                "is_generation": True,
                "weight_version": self.scheduler.weight_version,
                "preferred_sampling_params": None,
                "context_length": self.context_length,
                **self.weights.info(),
            }
        )

    async def generate(self, request: web.Request) -> web.Response:
        prompts, single = parse_generate(await _json(request), self._tokenize, self.runner.vocab_size)
        for prompt in prompts:
            self._fit(prompt)
        loop = asyncio.get_running_loop()
        pairs = []
        for p in prompts:
            for k in range(p.params.n):
                rid = p.rid if p.params.n == 1 else f"{p.rid}-{k}"
                pairs.append((Sequence(rid, p.input_ids, p.params, loop.create_future()), p))
        await self.scheduler.generate([seq for seq, _ in pairs])
        decode = self.runner.tokenizer.decode
        out = [response(s, p, decode(s.output_ids, skip_special_tokens=p.params.skip_special_tokens)) for s, p in pairs]
        return web.json_response(out[0] if single else out)

    def _fit(self, prompt: Prompt) -> None:
        """SGLang's context-length rule for one prompt: a 400, or (--allow-auto-truncate) cut to fit."""
        context, params = self.context_length, prompt.params
        problem = fit(len(prompt.input_ids), params.max_new_tokens, context)
        if not problem:
            return
        if not self.allow_auto_truncate:
            raise RequestError(problem)
        log.warning("%s Truncating (--allow-auto-truncate).", problem)
        del prompt.input_ids[context:]  # as SGLang cuts: the prompt, then max_new_tokens
        params.max_new_tokens = max(0, min(params.max_new_tokens, context - len(prompt.input_ids)))

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache is kept across requests, so a flush only has SGLang's rule to follow."""
        try:
            timeout_s = float(request.query.get("timeout", 0.0))
        except ValueError:
            raise RequestError(f"timeout={request.query['timeout']!r} is not a number of seconds") from None
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.scheduler.idle():
            if asyncio.get_running_loop().time() >= deadline:
                message = "Timed out waiting for idle state." if timeout_s > 0 else "Flush cache failed.\n"
                return web.Response(status=400, text=message)
            await asyncio.sleep(_FLUSH_POLL_S)
        return web.Response(text=FLUSHED)

    async def pause(self, request: web.Request) -> web.Response:
        body = await read_body(request, requests.PAUSE)
        await self.scheduler.pause(body.get("mode", "abort"))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        await read_body(request, requests.CONTINUE)
        await self.scheduler.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        body = await read_body(request, requests.ABORT)
        rid = body.get("rid") or ""
        if body.get("abort_all"):
            self.scheduler.abort()
        elif rid:
            self.scheduler.abort(rid)
        else:
            log.warning("Ignore abort_request with empty rid and abort_all=False")
        return web.Response(status=200)

    def _tokenize(self, text: str) -> list[int]:
        return self.runner.tokenizer(text, add_special_tokens=False)["input_ids"]


@web.middleware
async def _errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        log.warning("%s %s: %s", request.method, request.path, e)
        return web.json_response({"error": {"message": str(e)}}, status=400)


async def _json(request: web.Request) -> Any:
    if not request.can_read_body:
        raise RequestError("the body must be a JSON object")
    try:
        return await request.json()
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
