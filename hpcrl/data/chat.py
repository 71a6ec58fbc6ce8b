"""The prompt as the model sees it: the tokenizer's chat template on string prompts, and on chat-format rows.

``dataset.chat_template``:

    true   every string prompt becomes one user turn through the tokenizer's chat template, with the
           assistant's turn opened (``add_generation_prompt``); a tokenizer without a template is an error
    false  string prompts go to the model as they are (a base model, or a completion task like mod10)
    auto   true when the tokenizer has a chat template, else false

A chat-format row (``messages``: a list of ``{role, content}``, ``files.py``) goes through the template
whatever the setting, as it cannot be text otherwise; without a template, or with ``false``, it is an error.
The first row's rendered prompt is logged once, so what the model sees is in the controller's log.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from hpcrl.data.files import DataError

log = logging.getLogger(__name__)

MODES = ("true", "false", "auto")


def uses_template(mode: str, tokenizer: Any, where: str = "the model's tokenizer") -> bool:
    """Whether string prompts go through the chat template under ``dataset.chat_template=mode``."""
    if mode not in MODES:
        raise DataError(f"dataset.chat_template={mode!r} is invalid: expected one of {', '.join(MODES)}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "true" and not has:
        raise DataError(
            f"dataset.chat_template=true, but {where} has no chat template: set dataset.chat_template=false (or "
            "auto), or use a model directory whose tokenizer_config.json or chat_template.jinja holds one"
        )
    return mode == "true" or (mode == "auto" and has)


def render_prompts(
    rows: list[dict[str, Any]], tokenizer: Any, mode: str, where: str = "the model's tokenizer"
) -> list[dict[str, Any]]:
    """``rows`` with each ``prompt`` as the model sees it, and no ``messages``; logs the first one."""
    templated = uses_template(mode, tokenizer, where)
    out = []
    for i, row in enumerate(rows):
        messages = json.loads(row["messages"]) if row.get("messages") else None
        if messages is not None and not templated:
            why = "has no chat template" if mode == "auto" else "is not used: dataset.chat_template=false"
            raise DataError(
                f"row {i} is a conversation (a list of messages), which only a chat template makes a prompt of, and "
                f"the template of {where} {why}; use string prompts, or a tokenizer with a chat template"
            )
        if messages is None and templated:
            messages = [{"role": "user", "content": row["prompt"]}]
        prompt = row["prompt"] if messages is None else _apply(tokenizer, messages, i)
        out.append({**{k: v for k, v in row.items() if k != "messages"}, "prompt": prompt})
    if out:
        log.info("the first row's prompt as the model sees it (dataset.chat_template=%s): %r", mode, out[0]["prompt"])
    return out


def _apply(tokenizer: Any, messages: list[dict[str, str]], i: int) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja's errors: a template that wants roles in another order, say
        raise DataError(f"row {i}: the chat template fails on its messages: {type(e).__name__}: {e}") from e
