"""A model's context length as SGLang reads it, and what a request may ask for within it.

SGLang takes the context length from ``--context-length`` when given, else from the model's
``config.json``: the first of ``max_sequence_length``, ``seq_length``, ``max_seq_len``,
``model_max_length``, ``max_position_embeddings`` that is set, times the rope-scaling factor (except
llama3 rope scaling and configs that name an ``original_max_position_embeddings``), 2048 when none is
set. A request is refused with HTTP 400 when its prompt alone fills the context, or when prompt plus
``max_new_tokens`` exceeds it (``--allow-auto-truncate`` cuts instead). hpcrl's CPU server does the
same, and the client checks before sending (``InferenceClient(context_length=...)``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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


def context_length(model_path: str | Path, extra_args: Sequence[str] = ()) -> int:
    """The context length a server of ``model_path`` enforces: ``--context-length`` in ``extra_args`` (the
    last one, as SGLang's argparse keeps it), else the model's ``config.json``."""
    given = _flag_value(extra_args, "--context-length")
    if given is not None:
        try:
            return int(given)
        except ValueError:
            raise ValueError(f"inference.extra_args: --context-length {given!r} is not an integer") from None
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model's context length from {path}: {e}") from e
    return context_of_config(config.get("text_config") or config)


def fit(prompt_tokens: int, max_new_tokens: int, context: int) -> str:
    """Why a request of this size does not fit ``context`` (SGLang's words), or "" when it does."""
    if prompt_tokens >= context:
        return f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context} tokens)."
    if prompt_tokens + max_new_tokens > context:
        return (
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
            f"a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input messages "
            "or the completion to fit within the limit."
        )
    return ""


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    value = None
    for i, item in enumerate(args):
        if item == flag and i + 1 < len(args):
            value = args[i + 1]
        elif item.startswith(flag + "="):
            value = item.split("=", 1)[1]
    return value
