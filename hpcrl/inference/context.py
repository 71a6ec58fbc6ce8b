"""A model's context length as SGLang reads it, and what a request may ask for within it.

SGLang takes the context length from ``--context-length`` when given, else from the model's
``config.json``: the first of ``max_sequence_length``, ``seq_length``, ``max_seq_len``,
``model_max_length``, ``max_position_embeddings`` that is set, times the rope-scaling factor (except
llama3 rope scaling and configs that name an ``original_max_position_embeddings``), 2048 when none is
set. A request is refused with HTTP 400 when its prompt alone fills the context, when prompt plus
``max_new_tokens`` exceeds it, or when the prompt reaches SGLang's margin of 6 tokens below the context
(``max_input_len``); a request it serves stops generating 2 tokens before the context (``served``);
``--allow-auto-truncate`` cuts instead of refusing. Where SGLang's KV cache holds fewer tokens than the
context, the cache's size takes the context's place in the margin and the early stop (the GPU's memory
decides it, so neither hpcrl's client nor its CPU server can know it). hpcrl's CPU server applies the same
rules to its context length (it has no KV pool smaller than that), and the client checks before sending
(``InferenceClient(context_length=...)``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
DEFAULT_CONTEXT = 2048  # SGLang's when the config names none


def context_of_config(config: Mapping[str, Any]) -> int:
    """The context length of a Hugging Face config (as a dict), SGLang's way."""
    rope = config.get("rope_scaling") or {}
    factor = rope.get("factor", 1) if isinstance(rope, dict) else 1
    if not isinstance(rope, dict) or "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
        factor = 1
    for key in CONTEXT_KEYS:
        if config.get(key) is not None:
            return int(factor * config[key])
    return DEFAULT_CONTEXT


def context_length(model_path: str | Path) -> int:
    """The context length of ``model_path``'s ``config.json``, SGLang's way (``sglang_args.served_context`` applies
    what ``inference.extra_args`` changes)."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model's context length from {path}: {e}") from e
    return context_of_config(config.get("text_config") or config)


def max_input_len(context: int) -> int:
    """SGLang's ``max_req_input_len`` for a server whose context (or KV cache, if smaller) holds ``context`` tokens:
    ``max_req_len - 5`` with ``max_req_len = context - 1`` (``managers/tp_worker.py::get_worker_info``). A prompt
    of this many tokens or more is refused (``managers/utils.py::validate_input_length``), so the longest prompt
    SGLang serves is one token shorter."""
    return context - 1 - 5


def fit(prompt_tokens: int, max_new_tokens: int, context: int) -> str:
    """Why SGLang refuses a request of this size (its message, HTTP 400), or "" when it serves it.

    SGLang's tokenizer manager checks first (``_validate_one_request``: the prompt must be shorter than the
    context, prompt + ``max_new_tokens`` at most the context), then its scheduler (the prompt must be shorter
    than ``max_input_len``)."""
    if prompt_tokens >= context:
        return f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context} tokens)."
    if prompt_tokens + max_new_tokens > context:
        return (
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
            f"a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input messages "
            "or the completion to fit within the limit."
        )
    if prompt_tokens >= max_input_len(context):
        return (
            f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length ({max_input_len(context)} "
            "tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    return ""


def served(prompt_tokens: int, max_new_tokens: int, context: int) -> tuple[int, int]:
    """(prompt tokens, new tokens at most) that SGLang serves of a request ``fit`` accepts, or of any request
    with ``--allow-auto-truncate``, in SGLang's order: the tokenizer manager cuts the prompt to the context,
    then ``max_new_tokens`` to what is left; the scheduler stops generation one token before ``max_req_len``
    (``init_req_max_new_tokens``: prompt + new tokens at most ``context - 2``), then cuts the prompt to
    ``max_input_len`` (``validate_input_length``), after the cap was computed from the longer prompt."""
    prompt_tokens = min(prompt_tokens, context)
    if prompt_tokens + max_new_tokens > context:
        max_new_tokens = max(0, context - prompt_tokens)
    max_new_tokens = max(0, min(max_new_tokens, (context - 1) - prompt_tokens - 1))
    return min(prompt_tokens, max(max_input_len(context), 0)), max_new_tokens
