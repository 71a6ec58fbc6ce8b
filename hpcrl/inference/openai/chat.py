"""Chat messages to a prompt, and a generated turn back to content and tool calls.

    chat = ChatFormat(tokenizer, template="", tool_parser="hermes")
    ids = chat.prompt_ids(messages, tools)               # the chat template, with the generation prompt
    content, calls = chat.parse(text, tools)             # the turn's text, its tool calls pulled out

The template is the tokenizer's, or one named (``templates.py``) or read from a ``.jinja`` file, as SGLang's
``--chat-template``. Tools reach the template as ``tools`` (when ``tool_choice`` is not ``none``, as in SGLang);
how it renders them, and a call in an earlier assistant turn, is the template's. A template that takes no
``tools`` renders none, as in SGLang.

Tool calls are read from the text by the parser named (SGLang's ``--tool-call-parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as Qwen2.5, Qwen3 and the
  Hermes models write them (SGLang's ``hermes`` and ``qwen25``); the content is the text before the first block;
  a block that is not a JSON object naming a tool of the request leaves the whole text as content;
- ``tiny``: a turn that is exactly ``?`` calls the request's one tool with no arguments: the call syntax of the
  ``tiny_tools`` template, one token, which a tiny model can learn from scratch (docs/agents.md);
- ``none``: no parsing; the text is the content.

Messages are what the OpenAI API sends, normalised as SGLang does before templating: a content of text parts
becomes one string, a null content an empty one, a call's JSON ``arguments`` an object (templates write them
with ``tojson``).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path
from typing import Any

from hpcrl.inference.openai.errors import OpenAIError
from hpcrl.inference.openai.templates import TEMPLATES

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool", "function", "developer", "latest_reminder", "root")  # SGLang's
TOOL_PARSERS = ("hermes", "tiny", "none")
TINY_CALL = "?"  # the tiny parser's whole call
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MESSAGE_KEYS = {"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content"}
_MESSAGE_KEYS |= {"tools", "phase", "prefix", "refusal", "annotations", "audio", "function_call"}


def resolve_template(spec: str) -> str | None:
    """The Jinja text of ``spec``: a name in ``templates.TEMPLATES``, a ``.jinja`` file; "" = None (the tokenizer's)."""
    if not spec:
        return None
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    path = Path(spec)
    if path.suffix == ".jinja" and path.is_file():
        return path.read_text()
    raise ValueError(
        f"chat template {spec!r} is neither one of hpcrl's ({', '.join(TEMPLATES)}) nor a .jinja file that exists"
    )


class ChatFormat:
    """A tokenizer's chat template (or one given) and a tool-call parser."""

    def __init__(self, tokenizer: Any, template: str = "", tool_parser: str = "hermes"):
        if tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool parser {tool_parser!r} is invalid: expected one of {', '.join(TOOL_PARSERS)}")
        self.tokenizer, self.tool_parser = tokenizer, tool_parser
        self.template = resolve_template(template) or getattr(tokenizer, "chat_template", None)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` (and ``tools``), ending with the template's generation prompt."""
        if not self.template:
            raise OpenAIError(
                "the model's tokenizer has no chat template: use /v1/completions with a prompt of your own, or give "
                "the server a chat template"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, chat_template=self.template, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # jinja's errors (a template that raises on these messages) are the request's
            raise OpenAIError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e

    def own_text(self) -> str:
        """What the template itself writes around a conversation of empty turns (each role, a tool call, a tool
        result, the generation prompt): the characters a tiny model's alphabet needs besides the task's."""
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
        turns = [("system", {}), ("user", {}), ("assistant", {"tool_calls": [call]}), ("tool", {"tool_call_id": "c"})]
        return self.render([{"role": role, "content": "", **extra} for role, extra in [*turns, ("assistant", {})]])

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = self.render(messages, tools)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check_tools(self, tools: list[dict[str, Any]], tool_choice: str) -> None:
        """A request's tools that this parser cannot tell apart: a 400 before anything is generated."""
        if self.tool_parser == "tiny" and tools and tool_choice != "none" and len(tools) != 1:
            raise OpenAIError(
                f"the 'tiny' tool-call format calls a request's one tool, and this request has {len(tools)}",
                param="tools",
            )

    def parse(self, text: str, tools: list[dict[str, Any]], tool_choice: str = "auto") -> tuple[str, list[dict]]:
        """``(content, tool_calls)`` of a generated turn; no calls unless the request has tools and allows them."""
        if not tools or tool_choice == "none" or self.tool_parser == "none":
            return text, []
        names = [t["function"]["name"] for t in tools]
        if self.tool_parser == "tiny":
            return ("", [tool_call(names[0], {})]) if text.strip() == TINY_CALL else (text, [])
        return parse_hermes(text, names)


def parse_hermes(text: str, names: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Hermes blocks ``<tool_call>{json}</tool_call>``: (the text before the first, the calls); a block that is not a
    call of a tool in ``names`` leaves the whole text as content (logged), as SGLang's parser does."""
    blocks = _HERMES.findall(text)
    if not blocks:
        return text, []
    calls = []
    for raw in blocks:
        try:
            call = json.loads(raw.strip())
        except ValueError:
            log.warning("a <tool_call> block is not JSON; the turn is returned as content: %r", raw[:200])
            return text, []
        if not isinstance(call, dict) or call.get("name") not in names:
            log.warning("a <tool_call> block names no tool of the request (%s): %r", names, raw[:200])
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(tool_call(call["name"], arguments))
    return text[: text.find("<tool_call>")].strip(), calls


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One call as the API answers it: arguments as a JSON string."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def normalize_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Tools as the template reads them; each must be a function with a name, and names must not repeat."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        is_function = (
            isinstance(fn, dict) and isinstance(fn.get("name"), str) and tool.get("type", "function") == "function"
        )
        if not is_function:
            raise OpenAIError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                param="tools",
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise OpenAIError(f"Tool {i} function has invalid 'parameters' schema: not an object", param="tools")
        out.append({"type": "function", "function": dict(fn)})
    names = [t["function"]["name"] for t in out]
    if len(names) != len(set(names)):
        raise OpenAIError(f"tool names must be unique, got {names}", param="tools")
    return out


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages as a chat template reads them (module docstring); a 400 naming the message for a bad one."""
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise OpenAIError(f"{where} must be an object with a 'role'", param="messages")
    role = m["role"].lower()
    if role not in ROLES:
        raise OpenAIError(f"{where}: 'role' must be one of {', '.join(map(repr, ROLES))}", param="messages")
    unknown = sorted(k for k, v in m.items() if k not in _MESSAGE_KEYS and v is not None)
    if unknown:
        raise OpenAIError(f"{where}: unknown field(s) {unknown}", param="messages")
    if role == "user" and m.get("content") is None:
        raise OpenAIError(f"{where}: a user message needs a content", param="messages")
    out = {k: v for k, v in m.items() if v is not None and k in _MESSAGE_KEYS - {"refusal", "annotations", "audio"}}
    out["role"], out["content"] = role, _text(m.get("content"), where)
    if m.get("tool_calls") is not None:
        out["tool_calls"] = [_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(m["tool_calls"])]
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"{where}: only text content parts are supported, got {kind!r}", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(f"{where}: content must be a string, a list of text parts or null", param="messages")


def _call(where: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError(f"{where} must be {{'function': {{'name': ..., 'arguments': ...}}}}", param="messages")
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise OpenAIError(f"{where}.function.arguments is not JSON: {arguments[:80]!r}", param="messages") from None
    function = {"name": fn["name"], "arguments": arguments if arguments is not None else {}}
    return {**{k: v for k, v in call.items() if k != "function"}, "type": "function", "function": function}


def decode_answer(
    tokenizer: Any, output_ids: list[int], finish_reason: str, sampling: Any, eos_ids: set[int]
) -> tuple[str, int | str | None]:
    """A turn's text as the API answers it, and the stop it matched (a token id, a stop string, or None).

    A turn ended by a stop token (end of sequence, or ``stop_token_ids``) does not show it; one ended by a stop
    string shows the text before it, unless ``no_stop_trim``. ``sampling`` is the request's ``Sampling``."""
    ids, matched = list(output_ids), None
    if finish_reason == "stop" and ids and (ids[-1] in eos_ids or ids[-1] in sampling.stop_token_ids):
        matched = ids.pop()
    text = tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
    if finish_reason == "stop" and matched is None:
        found = [(text.find(s), s) for s in sampling.stop if s in text]
        if found:
            at, matched = min(found)
            if not sampling.no_stop_trim:
                text = text[:at]
    return text, matched
