"""The CPU server's OpenAI-compatible routes, as SGLang 0.5.23 serves them: ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``.

Requests are checked as SGLang's request classes are (``hpcrl/inference/openai/protocol.py``): a field SGLang
has but this server cannot honour (streaming, penalties, constrained decoding, top logprobs, a required or
named ``tool_choice``) is a 400 naming it, and so is a field SGLang does not have. The body must be sent as
``application/json``, as SGLang requires. A chat is rendered with the model's chat template (or
``--chat-template``) and the tools, and tool calls are read from the answer by ``--tool-call-parser`` (none
by default, as in SGLang). Unset sampling parameters take the model's ``generation_config.json`` values,
else temperature 1, top_p 1, top_k -1; a chat without ``max_tokens`` may use the rest of the context. The
context rule is ``/generate``'s (a 400, or ``--allow-auto-truncate``). Errors have SGLang's shape,
``{"object": "error", "message", "type", "param", "code"}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from hpcrl.inference.openai.chat import ChatFormat, decode_answer
from hpcrl.inference.openai.errors import OpenAIError
from hpcrl.inference.openai.protocol import (
    Choice,
    Sampling,
    chat_response,
    completion_response,
    model_card,
    models_response,
    new_id,
    parse_chat,
    parse_completion,
)
from hpcrl.inference.server.sampling import RequestError, SamplingParams
from hpcrl.inference.server.scheduler import Sequence

log = logging.getLogger(__name__)
GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}  # OpenAI's and SGLang's


class OpenAIRoutes:
    """The routes over the server's runner and scheduler (``Server``, in ``app.py``)."""

    def __init__(self, server: Any, chat: ChatFormat, served_model_name: str = ""):
        self.server, self.chat = server, chat
        self.runner, self.scheduler = server.runner, server.scheduler
        self.model = served_model_name or self.runner.model_path  # SGLang's default served name: the model path
        self.defaults = {**GENERATION_DEFAULTS, **generation_defaults(self.runner.model_path)}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.*}", self.model_info),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ]

    async def models(self, _: web.Request) -> web.Response:
        """The served model, then each LoRA adapter loaded (SGLang's ``available_models``)."""
        listing = models_response(self.model, self.server.context_length)
        for ref in self.server.adapters.registry.values():
            listing["data"].append({**model_card(ref.name, None), "root": ref.path, "parent": self.model})
        return web.json_response(listing)

    async def model_info(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model:
            error = {"message": f"The model '{name}' does not exist", "type": "invalid_request_error"}
            return web.json_response({"error": {**error, "param": "model", "code": "model_not_found"}}, status=404)
        return web.json_response(model_card(self.model, self.server.context_length))

    async def completions(self, request: web.Request) -> web.Response:
        try:
            req = parse_completion(await _body(request))
            ids = [self._tokenize(p) if isinstance(p, str) else p for p in req.prompts]
            choices = await self._generate(ids, req.sampling, tools=[], tool_choice="none", model=req.model)
        except (OpenAIError, RequestError) as e:
            return _error(request, e)
        return web.json_response(
            completion_response(new_id("cmpl-"), req.model, choices, req.sampling.n, self.scheduler.weight_version)
        )

    async def chat_completions(self, request: web.Request) -> web.Response:
        try:
            req = parse_chat(await _body(request))
            self.chat.check_tools(req.tools, req.tool_choice)
            tools = req.tools if req.tool_choice != "none" else []
            ids = self.chat.prompt_ids(req.messages, tools)
            choices = await self._generate([ids], req.sampling, tools, req.tool_choice, model=req.model)
        except (OpenAIError, RequestError) as e:
            return _error(request, e)
        return web.json_response(
            chat_response(new_id("chatcmpl-"), req.model, choices, req.sampling.n, self.scheduler.weight_version)
        )

    async def _generate(
        self, prompts: list[list[int]], sampling: Sampling, tools: list[dict], tool_choice: str, model: str = ""
    ) -> list[Choice]:
        """``n`` answers of every prompt, prompt-major, as SGLang orders them; with the LoRA adapter ``model``
        names (``adapter_of``)."""
        loop = asyncio.get_running_loop()
        adapter = adapter_of(model, self.model)
        pairs = []
        for i, ids in enumerate(prompts):
            self._check_ids(ids, i)
            params = self._params(ids, sampling)
            for k in range(sampling.n):
                seed = None if sampling.seed is None else (sampling.seed + k) % 2**63  # n draws, n seeds
                rid = new_id("")
                pairs.append((Sequence(rid, ids, self._sampling_params(params, seed), loop.create_future()), ids))
        adapters = self.server.adapters
        for (seq, _), lora in zip(pairs, await adapters.resolve(adapter, [adapter] * len(pairs)), strict=True):
            seq.lora = lora
            adapters.hold(seq)
        await self.scheduler.generate([seq for seq, _ in pairs])
        return [self._choice(seq, len(ids), sampling, tools, tool_choice) for seq, ids in pairs]

    def _params(self, ids: list[int], sampling: Sampling) -> dict[str, Any]:
        """One sample's sampling parameters, after SGLang's context rules (``Server.admit``: a 400, or cut with
        auto-truncate, and the new tokens capped 2 short of the context)."""
        context = self.server.context_length
        params = sampling.params(self.defaults)
        asked = sampling.max_new_tokens
        if asked is not None and asked > context and not self.server.allow_auto_truncate:
            raise OpenAIError(
                f"max_completion_tokens is too large: {asked}.This model supports at most {context} completion tokens."
            )
        params.setdefault("max_new_tokens", max(context - len(ids), 0))
        params["max_new_tokens"] = self.server.admit(ids, params["max_new_tokens"])
        return params

    def _sampling_params(self, params: dict[str, Any], seed: int | None) -> SamplingParams:
        return SamplingParams.from_json({**params, "sampling_seed": seed})

    def _choice(self, seq: Sequence, prompt_tokens: int, sampling: Sampling, tools: list, tool_choice: str) -> Choice:
        reason = seq.finish_reason or {"type": "abort"}
        tokenizer = self.runner.tokenizer
        text, matched = decode_answer(tokenizer, seq.output_ids, reason["type"], sampling, self.runner.eos_ids)
        content, calls = self.chat.parse(text, tools, tool_choice)
        finish = "tool_calls" if calls and reason["type"] == "stop" else reason["type"]
        return Choice(
            output_ids=list(seq.output_ids),
            text=content,
            finish_reason=finish,
            matched_stop=None if finish == "tool_calls" else reason.get("matched", matched),
            logprobs=list(seq.logprobs) if sampling.logprobs else None,
            tokens=[tokenizer.decode([t]) for t in seq.output_ids] if sampling.logprobs else None,
            tool_calls=calls or None,
            prompt_tokens=prompt_tokens,
        )

    def _check_ids(self, ids: list[int], i: int) -> None:
        vocab = self.runner.vocab_size
        if not ids:
            raise OpenAIError("Prompt cannot be empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"prompt {i} holds token id {bad[0]}, not one in 0..{vocab - 1}", param="prompt")

    def _tokenize(self, text: str) -> list[int]:
        return self.runner.tokenizer(text, add_special_tokens=False)["input_ids"]


def adapter_of(model: str, served: str) -> str | None:
    """The LoRA adapter an OpenAI request's ``model`` names, as SGLang 0.5.23 reads it
    (``serving_base._parse_model_parameter``): ``<served name>:<adapter>``, or ``<anything>:<adapter>``; None
    without a colon, for the served name itself, or with nothing after the colon. (SGLang's ``lora_path``
    field on these routes is refused by ``hpcrl.inference.openai.protocol``.)"""
    if ":" not in model or model == served:
        return None
    adapter = model[len(served) + 1 :] if model.startswith(f"{served}:") else model.split(":", 1)[1]
    return adapter.strip() or None


def generation_defaults(model_path: str) -> dict[str, Any]:
    """The sampling defaults a model's ``generation_config.json`` sets (SGLang's preferred over OpenAI's)."""
    path = Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in GENERATION_DEFAULTS if config.get(k) is not None}


async def _body(request: web.Request) -> Any:
    if request.content_type != "application/json":
        raise OpenAIError(f"Unsupported Media Type: Only 'application/json' is allowed (got {request.content_type!r})")
    try:
        return await request.json()
    except ValueError as e:
        raise OpenAIError(f"the body is not valid JSON: {e}") from None


def _error(request: web.Request, e: Exception) -> web.Response:
    """SGLang's error answer on its OpenAI routes."""
    status, param = getattr(e, "status", 400), getattr(e, "param", None)
    log.warning("%s %s: %s", request.method, request.path, e)
    body = {"object": "error", "message": str(e), "type": "BadRequest", "param": param, "code": status}
    return web.json_response(body, status=status)
