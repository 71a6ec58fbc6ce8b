"""SGLang's ``/generate`` request and response, as JSON, for the CPU server.

A request holds exactly one of ``text`` / ``input_ids``, single or batched; ``sampling_params``,
``return_logprob`` and ``rid`` may be one value or one per prompt. ``n`` samples of one prompt come
back as a list, prompt-major, like a batch. Fields the CPU server cannot honour are refused with
HTTP 400 rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from hpcrl.inference.server.sampling import RequestError, SamplingParams

KNOWN_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "rid", "stream"}
KNOWN_FIELDS |= {"logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}


@dataclass
class Prompt:
    """One prompt of a request, before ``n`` expands it into sequences."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool


def parse_generate(body: Any, tokenize, vocab_size: int) -> tuple[list[Prompt], bool]:
    """Prompts of a /generate body and whether the answer is a single object (not a list)."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise RequestError(f"unsupported field(s) {unknown}; hpcrl's CPU server supports {sorted(KNOWN_FIELDS)}")
    _refuse_unsupported(body)
    ids = _input_ids(body, tokenize)
    batched = bool(ids) and isinstance(ids[0], list)
    prompts_ids = ids if batched else [ids]
    if not prompts_ids:
        raise RequestError("input_ids must not be an empty batch")
    prompts = []
    for i, prompt_ids in enumerate(prompts_ids):
        where = f"input_ids[{i}]" if batched else "input_ids"
        _check_ids(prompt_ids, where, vocab_size)
        params = SamplingParams.from_json(_nth(body.get("sampling_params"), i, batched), _nth_where(body, i, batched))
        rid = _nth(body.get("rid"), i, batched) or uuid.uuid4().hex
        prompts.append(Prompt(str(rid), prompt_ids, params, bool(_nth(body.get("return_logprob"), i, batched))))
    single = not batched and prompts[0].params.n == 1
    return prompts, single


def response(seq, prompt: Prompt, text: str) -> dict[str, Any]:
    """One sequence's answer in SGLang's shape."""
    meta = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "weight_version": seq.weight_version,
        "e2e_latency": time.monotonic() - seq.started,
    }
    if prompt.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.logprobs, seq.output_ids, strict=True)]
    return {"text": text, "output_ids": seq.output_ids, "meta_info": meta}


def _refuse_unsupported(body: dict) -> None:
    if body.get("stream"):
        raise RequestError("stream=true is not supported by hpcrl's CPU server")
    if body.get("top_logprobs_num"):
        raise RequestError("top_logprobs_num is not supported by hpcrl's CPU server")
    if body.get("logprob_start_len", -1) != -1:
        raise RequestError("only logprob_start_len=-1 (output tokens) is supported by hpcrl's CPU server")


def _input_ids(body: dict, tokenize) -> list:
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise RequestError("exactly one of text and input_ids must be given")
    if has_ids:
        ids = body["input_ids"]
        if not isinstance(ids, list):
            raise RequestError("input_ids must be a list of token ids or a list of such lists")
        return ids
    text = body["text"]
    if isinstance(text, str):
        return tokenize(text)
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [tokenize(t) for t in text]
    raise RequestError("text must be a string or a non-empty list of strings")


def _check_ids(ids: Any, where: str, vocab_size: int) -> None:
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{where} must be a non-empty list of token ids")
    for j, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise RequestError(f"{where}[{j}]={t!r} is not a token id in 0..{vocab_size - 1}")


def _nth(value: Any, i: int, batched: bool) -> Any:
    if not (batched and isinstance(value, list)):
        return value
    if i >= len(value):
        raise RequestError(f"a per-prompt list has {len(value)} entries, fewer than the prompts in input_ids")
    return value[i]


def _nth_where(body: dict, i: int, batched: bool) -> str:
    return f"sampling_params[{i}]" if batched and isinstance(body.get("sampling_params"), list) else "sampling_params"
