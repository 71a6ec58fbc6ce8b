"""SGLang's ``/generate`` request and response, as JSON, for the CPU server.

A request holds exactly one of ``text`` / ``input_ids``, single or batched; ``sampling_params`` and
``return_logprob`` may be one value or one per prompt. ``n`` samples of one prompt come back as a list,
prompt-major, like a batch. Fields the CPU server cannot honour are refused with HTTP 400 rather than
silently ignored.

``rid`` is SGLang's (``srt/managers/io_struct.py``, ``GenerateReqInput._normalize_rid`` and
``_validate_rid_uniqueness``): a single prompt keeps its string (a fresh hex id without one); a batch
given one string ``r`` makes ``r_0``, ``r_1``, ...; a list names each prompt and must have one entry per
prompt; a rid twice in one batch is a 400. With ``n > 1`` every sample gets a fresh hex id, as SGLang's
tokenizer manager gives it (``regenerate_rid``): such samples cannot be aborted by the rid sent.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hpcrl.inference.server.sampling import RequestError, SamplingParams

KNOWN_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "rid", "stream"}
KNOWN_FIELDS |= {"logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "lora_path"}


@dataclass
class Prompt:
    """One prompt of a request, before ``n`` expands it into sequences."""

    rids: list[str]  # one per sample (``n`` of them)
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
        prompts.append(Prompt([], prompt_ids, params, bool(_nth(body.get("return_logprob"), i, batched))))
    n = _parallel_samples(prompts)
    single = not batched and n == 1
    for prompt, rids in zip(prompts, sample_rids(body.get("rid"), len(prompts), n, single), strict=True):
        prompt.rids = rids
    return prompts, single


def sample_rids(rid: Any, batch_size: int, n: int, single: bool) -> list[list[str]]:
    """Each prompt's sample rids from a request's ``rid``, as SGLang makes them (see the module docstring)."""
    if single:
        if rid is not None and not isinstance(rid, str):
            raise RequestError(f"rid must be a string for a single prompt, got {rid!r}")
        return [[uuid.uuid4().hex if rid is None else rid]]
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(batch_size * n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(batch_size * n)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != batch_size:
            raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
        rids = rid
    else:
        raise RequestError("The rid should be a string or a list of strings.")
    duplicates = [r for r, count in Counter(rids).items() if count > 1]
    if duplicates:
        raise RequestError(f"Duplicate request IDs detected within the request: {duplicates}")
    if n > 1:
        return [[uuid.uuid4().hex for _ in range(n)] for _ in range(batch_size)]
    return [[r] for r in rids]


def lora_paths(body: dict, batch_size: int, single: bool) -> tuple[Any, list[Any]]:
    """``lora_path`` as SGLang's ``GenerateReqInput._normalize_lora_paths`` leaves it: (the value its LoRA checks
    look at, each prompt's adapter name). A single prompt takes a string; a batch (or ``n > 1``) a string for
    every prompt or a list with one name (or null: the base model) per prompt. SGLang indexes a list of another
    length by sample and fails on a short one; here that is a 400."""
    raw = body.get("lora_path")
    if raw is None:
        return None, [None] * batch_size
    if isinstance(raw, str):
        return (raw, [raw]) if single else ([raw] * batch_size, [raw] * batch_size)
    if not isinstance(raw, list) or not all(x is None or isinstance(x, str) for x in raw):
        raise RequestError("lora_path should be a list or a string.")
    if single:
        raise RequestError("lora_path must be a string for a single prompt (a list names one adapter per prompt)")
    if len(raw) != batch_size:
        raise RequestError(f"lora_path list length ({len(raw)}) must match batch size ({batch_size})")
    return raw, list(raw)


def _parallel_samples(prompts: list[Prompt]) -> int:
    """``n``, which SGLang requires to be the same for every prompt of a request."""
    counts = {p.params.n for p in prompts}
    if len(counts) > 1:
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
    return counts.pop()


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


def output_text(output_ids: list[int], finish_reason: dict[str, Any] | None, decode) -> str:
    """A sequence's ``text``, as SGLang's detokenizer makes it (``managers/detokenizer_manager.py``,
    ``trim_matched_stop``): without the stop token that ended it (its id stays in ``output_ids`` and in
    ``finish_reason.matched``), cut before the first occurrence of the stop string that ended it."""
    matched = (finish_reason or {}).get("matched")
    ids = output_ids[:-1] if isinstance(matched, int) and output_ids else output_ids
    text = decode(ids)
    at = text.find(matched) if isinstance(matched, str) else -1
    return text[:at] if at != -1 else text


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
