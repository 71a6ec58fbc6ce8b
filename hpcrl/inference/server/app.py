"""The CPU server's HTTP routes: the subset of SGLang 0.5.23's API that hpcrl uses, as strictly as SGLang.

Generation, health, pause and the cache are here; the weight-update endpoints in ``weights.py``, the
OpenAI-compatible ones (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``) in
``openai_routes.py``. What SGLang does and this server does too (facts in ../shared/reference/sglang-http-api.md):

- ``/generate``: a prompt of the context length or longer, prompt + ``max_new_tokens`` over it, or a prompt
  within SGLang's 6-token margin of it, is a 400 with SGLang's message, and generation stops 2 tokens short
  of the context (``context.fit``, ``context.served``; ``--allow-auto-truncate`` cuts instead). SGLang
  applies the margin and the stop to its KV cache's size where that is smaller than the context; this
  server has no KV pool smaller than its context, so its context length is the one limit;
- ``rid``: a batch given one string makes ``rid_0``, ``rid_1``, ...; a rid twice in one request, or one that a
  request in flight holds, is a 400; ``n > 1`` samples get fresh ids (``protocol.py``);
- ``text`` leaves out the stop token that ended the sequence and is cut before the stop string that ended it;
  ``ignore_eos`` turns off ``stop_token_ids`` too;
- ``/health`` answers 200 once a one-token generation comes back, and 503 when it has not within
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (20), as while generation is paused: the generation waits behind
  the pause, so a paused server answers 503 only after that delay, as SGLang does. SGLang looks for the
  answer once a second, so its 200 takes at least a second; this server answers as soon as it has it;
- ``/flush_cache`` is a 400 while requests run or wait (waiting ones are fine while paused), or after
  waiting ``?timeout=S`` for that; a negative or non-numeric ``timeout`` is a 400 (FastAPI's validation);
- ``/abort_request`` with a ``rid`` aborts nothing unless a request with exactly that rid is in flight, and
  then every request whose rid starts with it (SGLang's tokenizer manager forwards only a rid it knows, its
  scheduler matches by prefix); ``abort_all`` aborts all; an empty rid without ``abort_all`` aborts nothing;
  the answer is an empty 200;
- ``/pause_generation`` and ``/continue_generation`` need a JSON body (``{}`` at least);
- ``lora_path`` names each prompt's LoRA adapter (``protocol.lora_paths``, ``lora.py``: the LoRA routes, the
  registry, SGLang's refusals).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import uuid
from typing import Any

from aiohttp import web

from hpcrl.inference.context import fit, served
from hpcrl.inference.openai.chat import ChatFormat
from hpcrl.inference.server import requests
from hpcrl.inference.server.classify import refuse_classify
from hpcrl.inference.server.lora import Adapters, LoraSettings
from hpcrl.inference.server.openai_routes import OpenAIRoutes
from hpcrl.inference.server.protocol import lora_paths, output_text, parse_generate, response
from hpcrl.inference.server.requests import MAX_BODY_BYTES, errors_as_json, read_body
from hpcrl.inference.server.runner import ModelRunner
from hpcrl.inference.server.sampling import RequestError, SamplingParams
from hpcrl.inference.server.scheduler import Scheduler, Sequence
from hpcrl.inference.server.weights import WeightUpdates

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"  # SGLang's variable for its HEALTH_CHECK_TIMEOUT, read as here
HEALTH_TIMEOUT_S = 20  # its default, in whole seconds
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
        adapters: Adapters | None = None,  # the LoRA adapters; None: LoRA off, as without --enable-lora
    ):
        self.runner, self.scheduler, self.weights = runner, scheduler, weights
        self.adapters = adapters or Adapters(LoraSettings(), runner, scheduler)
        self.context_length = context_length
        self.allow_auto_truncate = allow_auto_truncate
        self.health_timeout_s = health_timeout_s(os.environ)
        self.openai = OpenAIRoutes(self, chat or ChatFormat(runner.tokenizer, tool_parser="none"), served_model_name)
        self.loop_task: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors_as_json])
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
                post("/classify", refuse_classify),  # a generation model: SGLang's 400 (classify.py)
                post("/encode", refuse_classify),
                *self.weights.routes(),
                *self.adapters.routes(),
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
        """200 once a one-token generation came back; 503 when it does not within the health timeout, which
        is what a pause makes of it (the generation waits behind the pause), as in SGLang's
        ``health_generate``."""
        if self.loop_task is None or self.loop_task.done():
            return web.Response(status=503)
        rid = f"{HEALTH_RID_PREFIX}_{uuid.uuid4().hex}"
        probe = Sequence(
            rid, [0], SamplingParams(max_new_tokens=1, temperature=0), asyncio.get_running_loop().create_future()
        )
        try:
            await asyncio.wait_for(self.scheduler.generate([probe]), self.health_timeout_s)
        except TimeoutError:
            self.scheduler.abort(rid)
            log.error("health check failed: no generation within %d s", self.health_timeout_s)
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
        body = await _json(request)
        prompts, single = parse_generate(body, self._tokenize, self.runner.vocab_size)
        lora_path, names = lora_paths(body, len(prompts), single)
        for prompt in prompts:
            prompt.params.max_new_tokens = self.admit(prompt.input_ids, prompt.params.max_new_tokens)
        adapters = await self.adapters.resolve(
            lora_path, [name for p, name in zip(prompts, names, strict=True) for _ in p.rids]
        )
        loop = asyncio.get_running_loop()
        samples = [(rid, p) for p in prompts for rid in p.rids]
        pairs = [
            (Sequence(rid, p.input_ids, p.params, loop.create_future(), lora=adapter), p)
            for (rid, p), adapter in zip(samples, adapters, strict=True)
        ]
        try:
            self._refuse_rids_in_flight([seq.rid for seq, _ in pairs])  # no await from here to the queue
        except RequestError:
            self.adapters.release(adapters)
            raise
        for seq, _ in pairs:
            self.adapters.hold(seq)
        await self.scheduler.generate([seq for seq, _ in pairs])
        tokenizer = self.runner.tokenizer
        out = []
        for seq, p in pairs:
            decode = functools.partial(tokenizer.decode, skip_special_tokens=p.params.skip_special_tokens)
            out.append(response(seq, p, output_text(seq.output_ids, seq.finish_reason, decode)))
        return web.json_response(out[0] if single else out)

    def _refuse_rids_in_flight(self, rids: list[str]) -> None:
        """SGLang's tokenizer manager refuses a rid that a request in flight holds (``_init_req_state``)."""
        taken = self.scheduler.rids_in_flight()
        for rid in rids:
            if rid in taken:
                raise RequestError(f"Duplicate request ID detected: {rid}")

    def admit(self, input_ids: list[int], max_new_tokens: int) -> int:
        """SGLang's context rules for one prompt (``context.fit``, ``context.served``): a 400, or the prompt cut
        in place (--allow-auto-truncate); returns the new tokens it may generate, which stop 2 tokens short
        of the context as SGLang's do. The context is the server's context length: the CPU server has no KV
        pool smaller than it, which on SGLang would take its place."""
        context = self.context_length
        problem = fit(len(input_ids), max_new_tokens, context)
        if problem and not self.allow_auto_truncate:
            raise RequestError(problem)
        if problem:
            log.warning("%s Truncating (--allow-auto-truncate).", problem)
        kept, max_new_tokens = served(len(input_ids), max_new_tokens, context)
        del input_ids[kept:]
        return max_new_tokens

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache is kept across requests, so a flush only has SGLang's rule to follow."""
        timeout_s = _flush_timeout(request.query.get("timeout", "0"))
        if isinstance(timeout_s, web.Response):
            return timeout_s
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


def health_timeout_s(environ) -> int:
    """Seconds /health waits for its generation: ``SGLANG_HEALTH_CHECK_TIMEOUT``, whole seconds as SGLang reads it
    (``int(os.getenv(...))`` in ``srt/entrypoints/http_server.py``), default 20."""
    raw = environ.get(HEALTH_TIMEOUT_ENV, str(HEALTH_TIMEOUT_S))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{HEALTH_TIMEOUT_ENV}={raw!r} must be a whole number of seconds (SGLang's int())") from None


def _flush_timeout(raw: str) -> float | web.Response:
    """``/flush_cache``'s ``timeout``: SGLang declares it ``Query(0.0, ge=0.0)``; anything else is FastAPI's
    validation error, which SGLang answers with 400 and its ``ErrorResponse`` body."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value >= 0:
        return value
    message = f"timeout={raw!r}: Input should be greater than or equal to 0 (a number of seconds)"
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


async def _json(request: web.Request) -> Any:
    if not request.can_read_body:
        raise RequestError("the body must be a JSON object")
    try:
        return await request.json()
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
