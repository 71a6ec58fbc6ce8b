"""``/v1/completions`` and ``/v1/chat/completions`` bodies as SGLang 0.5.23 names them, and the answers.

Every field of SGLang's ``CompletionRequest`` and ``ChatCompletionRequest``
(``srt/entrypoints/openai/protocol.py``) is in one of three tables here: honoured (its value is used),
informational (any value of its type: it changes nothing, as in SGLang without the feature), or honoured only
at its default (any other value is a 400 naming the field, where SGLang would penalise, constrain or stream).
A field SGLang does not have is a 400 too; SGLang would ignore it silently. ``tests/inference`` keeps the
tables equal to SGLang's classes, read from its wheel.

What a body asks of generation becomes ``Sampling`` (SGLang's ``sampling_params`` names); unset values are
the caller's to fill (``Sampling.params``): hpcrl's CPU server fills SGLang's defaults, the rollout's proxy
the episode's. Errors are ``OpenAIError`` with the status to answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcrl.inference.openai.chat import normalize_messages, normalize_tools
from hpcrl.inference.openai.errors import OpenAIError

__all__ = ["ChatRequest", "Choice", "CompletionRequest", "OpenAIError", "Sampling", "parse_chat", "parse_completion"]

PD_ROUTING = {"bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank", "disagg_prefill_dp_rank"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _is_stop(v: Any) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _is_ids(v: Any) -> bool:
    return v is None or (isinstance(v, list) and all(_is_int(t) for t in v))


_BOOL = (lambda v: isinstance(v, bool), "true or false")
_OPT_STR = (_is_opt(lambda v: isinstance(v, str)), "a string or null")

# fields both endpoints honour: name -> (type check, the type in words)
_SAMPLING = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "n": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "stop": (_is_stop, "a string, a list of strings or null"),
    "seed": (_is_opt(_is_int), "an integer or null"),
    "stop_token_ids": (_is_ids, "a list of token ids or null"),
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "no_stop_trim": _BOOL,
}
# fields whose value changes nothing here: accepted with any value of their type
_INFORMATIONAL = {"user": _OPT_STR, "rid": (lambda v: v is None or isinstance(v, (str, list)), "a string or a list")}
_INFORMATIONAL["extra_key"] = _INFORMATIONAL["rid"]

CHAT_HONOURED = {
    **_SAMPLING,
    "messages": (lambda v: isinstance(v, list), "a list of messages"),
    "temperature": (_is_opt(lambda v: _is_num(v) and v >= 0), "a number >= 0 or null"),
    "top_p": (_is_opt(lambda v: _is_num(v) and 0 < v <= 1), "a number in (0, 1] or null"),
    "top_k": (_is_opt(lambda v: _is_int(v) and (v == -1 or v >= 1)), "-1, an integer >= 1 or null"),
    "max_tokens": (_is_opt(lambda v: _is_int(v) and v >= 1), "an integer >= 1 or null"),
    "max_completion_tokens": (_is_opt(lambda v: _is_int(v) and v >= 1), "an integer >= 1 or null"),
    "logprobs": _BOOL,
    "top_logprobs": (_is_opt(lambda v: v == 0), "0 or null (top logprobs are not supported)"),
    "tools": (_is_opt(lambda v: isinstance(v, list)), "a list of tools or null"),
    "tool_choice": (lambda v: v is None or isinstance(v, (str, dict)), '"auto", "none", an object or null'),
}
CHAT_INFORMATIONAL = {
    **_INFORMATIONAL,
    "parallel_tool_calls": _BOOL,  # every call the parser finds is returned either way
    "separate_reasoning": _BOOL,  # no reasoning parser: nothing to separate (SGLang without --reasoning-parser)
    "stream_reasoning": _BOOL,
    "return_flat_raw_top_logprobs_b64": _BOOL,  # only with return_meta_info, refused below
}
CHAT_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "stream": (False,),
    "stream_options": (None,),
    "min_p": (None, 0),
    "min_tokens": (0,),
    "repetition_penalty": (None, 1),
    "regex": (None,),
    "ebnf": (None,),
    "stop_regex": (None,),
    "continue_final_message": (False,),
    "chat_template_kwargs": (None, {}),
    "reasoning_effort": (None,),
    "thinking": (None,),
    "task": (None,),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "return_cached_tokens_details": (False,),
    "return_spec_tokens_details": (False,),
    "return_prompt_token_ids": (False,),
    "return_token_ids": (False,),
    "return_meta_info": (False,),
    "return_input_ids_in_sglext": (False,),
    "return_output_ids_in_sglext": (False,),
    "return_sampling_mask": (False,),
    "sampling_logprobs_mode": (None,),
    "return_flat_raw_output_top_logprobs": (False,),
    "lora_path": (None,),
    "session_id": (None,),
    "session_params": (None,),
    "max_dynamic_patch": (None,),
    "min_dynamic_patch": (None,),
    "use_audio_in_video": (False,),
    "images_config": (None,),
    "video_config": (None,),
    "mm_processor_kwargs": (None,),
    "custom_logit_processor": (None,),
    "custom_params": (None,),
    "watermark": (None,),
    "input_ids": (None,),
    "cache_salt": (None,),
    "priority": (None,),
    "data_parallel_rank": (None,),
    **dict.fromkeys(PD_ROUTING, (None,)),
}

COMPLETION_HONOURED = {
    **_SAMPLING,
    "prompt": (lambda v: isinstance(v, (str, list)), "a string, a list of strings or token ids"),
    "temperature": (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and (v == -1 or v >= 1), "-1 or an integer >= 1"),
    "max_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1 (max_tokens must be positive)"),
    "logprobs": (_is_opt(lambda v: v == 0), "0 (the sampled tokens' logprobs) or null; top logprobs are not supported"),
}
COMPLETION_INFORMATIONAL = dict(_INFORMATIONAL)
COMPLETION_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (False,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": (None, {}),
    "stream": (False,),
    "stream_options": (None,),
    "suffix": (None,),
    "min_p": (0,),
    "min_tokens": (0,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "repetition_penalty": (1,),
    "stop_regex": (None,),
    "response_format": (None, {"type": "text"}),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "return_cached_tokens_details": (False,),
    "return_spec_tokens_details": (False,),
    "return_token_ids": (False,),
    "lora_path": (None,),
    "session_id": (None,),
    "session_params": (None,),
    "custom_params": (None,),
    "custom_logit_processor": (None,),
    "watermark": (None,),
    "images_config": (None,),
    "mm_processor_kwargs": (None,),
    "data_parallel_rank": (None,),
    "cache_salt": (None,),
    "priority": (None,),
    "custom_labels": (None,),
    **dict.fromkeys(PD_ROUTING, (None,)),
}


@dataclass
class Sampling:
    """What one request asks of generation; None: the server's (or the proxy's) default."""

    n: int = 1
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep a matched stop string in the answer's text
    seed: int | None = None
    logprobs: bool = False  # return the sampled tokens' logprobs

    def params(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """SGLang's ``sampling_params`` of one sample (n=1): this request's values, ``defaults`` for unset ones."""
        given = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        params = {k: v for k, v in given.items() if v is not None}
        params = {**{k: v for k, v in defaults.items() if v is not None}, **params}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            params["ignore_eos"] = True
        if not self.skip_special_tokens:
            params["skip_special_tokens"] = False
        return params


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # as the chat template reads them (see chat.normalize_messages)
    tools: list[dict[str, Any]]  # [{"type": "function", "function": {"name": ..., ...}}]; [] when none
    tool_choice: str  # "auto" | "none" ("required" and a named tool need constrained decoding: refused)
    sampling: Sampling


@dataclass
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # each prompt: text, or token ids
    sampling: Sampling


def parse_chat(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions`` body, checked as SGLang's ``ChatCompletionRequest`` is (module docstring)."""
    body = _check_fields(body, CHAT_HONOURED, CHAT_INFORMATIONAL, CHAT_DEFAULT_ONLY, "ChatCompletionRequest")
    messages = body.get("messages")
    if messages is None:
        raise OpenAIError("field 'messages' is required", param="messages")
    if not messages:
        raise OpenAIError("Messages cannot be empty.", param="messages")
    tools = normalize_tools(body.get("tools") or [])
    choice = _tool_choice(body, tools)
    sampling = _sampling(body)
    sampling.max_new_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    sampling.logprobs = bool(body.get("logprobs"))
    return ChatRequest(str(body.get("model", "default")), normalize_messages(messages), tools, choice, sampling)


def parse_completion(body: Any) -> CompletionRequest:
    """A ``/v1/completions`` body, checked as SGLang's ``CompletionRequest`` is (module docstring)."""
    body = _check_fields(
        body, COMPLETION_HONOURED, COMPLETION_INFORMATIONAL, COMPLETION_DEFAULT_ONLY, "CompletionRequest"
    )
    if "prompt" not in body:
        raise OpenAIError("field 'prompt' is required", param="prompt")
    sampling = _sampling(body)
    sampling.max_new_tokens = body.get("max_tokens", 16)  # SGLang's (and OpenAI's) default for completions
    sampling.temperature = body.get("temperature", 1.0)
    sampling.top_p = body.get("top_p", 1.0)
    sampling.top_k = body.get("top_k", -1)
    sampling.logprobs = body.get("logprobs") is not None
    return CompletionRequest(str(body.get("model", "default")), _prompts(body["prompt"]), sampling)


def _check_fields(body: Any, honoured: dict, informational: dict, default_only: dict, cls: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object")
    for name, value in body.items():
        if name in honoured or name in informational:
            check, expected = honoured.get(name) or informational[name]
            if not check(value):
                raise OpenAIError(f"field {name!r} must be {expected}, got {_short(value)}", param=name)
        elif name in default_only:
            if value not in default_only[name]:
                allowed = " or ".join(json.dumps(v) for v in default_only[name])
                raise OpenAIError(
                    f"{name}={_short(value)} is not supported by hpcrl (only {allowed}, SGLang's default)", param=name
                )
        else:
            raise OpenAIError(
                f"unknown field {name!r}: SGLang's {cls} has no such field (SGLang would ignore it silently)",
                param=name,
            )
    return body


def _sampling(body: dict[str, Any]) -> Sampling:
    stop = body.get("stop")
    return Sampling(
        n=body.get("n", 1),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=body.get("top_k"),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(body.get("stop_token_ids") or []),
        ignore_eos=body.get("ignore_eos", False),
        skip_special_tokens=body.get("skip_special_tokens", True),
        no_stop_trim=body.get("no_stop_trim", False),
        seed=body.get("seed"),
    )


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    choice = body.get("tool_choice")
    if choice is None:  # SGLang's default: auto with tools, none without
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        raise OpenAIError(
            "a named tool_choice needs constrained decoding, which hpcrl does not do; use tool_choice='auto' and "
            "check the answer's tool_calls",
            param="tool_choice",
        )
    if choice == "required":
        if not tools:
            raise OpenAIError("Tools cannot be empty if tool choice is set to required.", param="tool_choice")
        raise OpenAIError(
            "tool_choice='required' needs constrained decoding, which hpcrl does not do; use tool_choice='auto'",
            param="tool_choice",
        )
    if choice not in ("auto", "none"):
        raise OpenAIError(f"tool_choice must be 'auto', 'none', 'required' or an object, got {choice!r}")
    return choice


def _prompts(prompt: Any) -> list[str | list[int]]:
    """SGLang's four prompt forms: a string, strings, token ids, lists of token ids."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif prompt and all(_is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise OpenAIError(
            "prompt must be a string, a list of strings, a list of token ids or a list of such lists", param="prompt"
        )
    if not prompts or all(not p for p in prompts):
        raise OpenAIError("Prompt cannot be empty", param="prompt")
    return prompts


# --- answers ------------------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One generated answer, as the response reports it."""

    output_ids: list[int]
    text: str  # the answer's text (a matched stop string trimmed unless no_stop_trim)
    finish_reason: str  # stop | length | abort | tool_calls
    matched_stop: int | str | None = None
    logprobs: list[float] | None = None  # of each output token, when the request asked for them
    tokens: list[str] | None = None  # each output token's text, for the logprobs
    tool_calls: list[dict[str, Any]] | None = None  # chat: parsed calls (then ``text`` is what is left)
    prompt_tokens: int = 0


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Token counts as SGLang reports them: a prompt counts once for its ``n`` answers."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(len(c.output_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def chat_response(rid: str, model: str, choices: list[Choice], n: int, weight_version: Any) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "reasoning_content": None}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        logprobs = None
        if c.logprobs is not None:
            logprobs = {"content": [_token_logprob(t, lp) for t, lp in zip(c.tokens or [], c.logprobs, strict=True)]}
        out.append(_choice(i, c, message=message, logprobs=logprobs))
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(choices, n),
        "metadata": {"weight_version": weight_version},
    }


def completion_response(rid: str, model: str, choices: list[Choice], n: int, weight_version: Any) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if c.logprobs is not None:
            tokens = c.tokens or []
            offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": list(c.logprobs),
                "tokens": tokens,
                "top_logprobs": [None] * len(tokens),
            }
        out.append(_choice(i, c, text=c.text, logprobs=logprobs))
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(choices, n),
        "metadata": {"weight_version": weight_version},
    }


def _choice(index: int, c: Choice, **fields: Any) -> dict[str, Any]:
    return {"index": index, **fields, "finish_reason": c.finish_reason, "matched_stop": c.matched_stop}


def _token_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "bytes": list(token.encode()), "logprob": logprob, "top_logprobs": []}


def models_response(model: str, context_length: int | None) -> dict[str, Any]:
    """``GET /v1/models``: the one model served (SGLang's ``ModelList`` without LoRA adapters)."""
    return {"object": "list", "data": [model_card(model, context_length)]}


def model_card(model: str, context_length: int | None) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": model,
        "parent": None,
        "max_model_len": context_length,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
