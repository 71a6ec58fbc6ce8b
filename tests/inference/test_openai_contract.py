"""hpcrl's OpenAI routes against SGLang 0.5.23's own OpenAI protocol, read from its wheel
(``srt/entrypoints/openai/protocol.py``, loaded as ``sglang_wheel.py`` loads io_struct.py: pydantic classes run
as they are, what they import from SGLang's runtime stood in).

- every field of SGLang's ``CompletionRequest`` and ``ChatCompletionRequest`` is in exactly one of hpcrl's tables
  (honoured, informational, honoured only at its default), and no table names a field SGLang lacks: a field
  SGLang adds fails here, so it cannot be silently refused or ignored;
- a default-only field accepts SGLang's default, so a body an SGLang client sends with defaults spelt out passes;
- the bodies the real ``openai`` client sends for the example agent's requests (a chat with tools, a tool result
  after a call, ``n``, ``stop``, ``seed``, logprobs; a completion of token ids) validate as SGLang's classes, and
  hpcrl's parser accepts them;
- the routes exist in SGLang with those methods.
"""

import asyncio
import typing

import openai
import pytest
from aiohttp import web

from hpcrl.inference.openai import protocol
from hpcrl.rollout.agents.mod10 import CALCULATOR
from tests.inference.sglang_wheel import Wheel, fetch_wheel, partial_module

TABLES = {
    "ChatCompletionRequest": (protocol.CHAT_HONOURED, protocol.CHAT_INFORMATIONAL, protocol.CHAT_DEFAULT_ONLY),
    "CompletionRequest": (
        protocol.COMPLETION_HONOURED, protocol.COMPLETION_INFORMATIONAL, protocol.COMPLETION_DEFAULT_ONLY
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    return Wheel(fetch_wheel())


@pytest.fixture(scope="module")
def sglang(wheel):
    """SGLang's two request classes (``typing_extensions.Literal`` is the one import they need for real)."""
    member = "srt/entrypoints/openai/protocol.py"
    return partial_module(
        "sglang_wheel.openai_protocol", wheel.source(member), f"{wheel.path}!sglang/{member}",
        list(TABLES), {"Literal": typing.Literal},
    )  # fmt: skip


@pytest.mark.parametrize("cls", TABLES)
def test_every_sglang_field_is_in_exactly_one_table(sglang, cls):
    fields = set(getattr(sglang, cls).model_fields)
    tables = [set(t) for t in TABLES[cls]]
    assert set.union(*tables) == fields, (sorted(fields - set.union(*tables)), sorted(set.union(*tables) - fields))
    assert sum(len(t) for t in tables) == len(fields), "a field is in two tables"


@pytest.mark.parametrize("cls", TABLES)
def test_a_default_only_field_accepts_sglangs_default(sglang, cls):
    model = getattr(sglang, cls)
    for name, allowed in TABLES[cls][2].items():
        default = model.model_fields[name].get_default(call_default_factory=True)
        assert default in allowed, f"{cls}.{name}: SGLang's default {default!r} is not in {allowed}"


async def bodies_the_client_sends() -> list[tuple[str, dict]]:
    """The bodies of the example agent's requests and of a completion, as the real client sends them."""
    seen: list[tuple[str, dict]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        message = {"role": "assistant", "content": "", "tool_calls": [CALL]}
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls", "text": ""}
        return web.json_response({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                  "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                                 "total_tokens": 2}})  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", record)
    app.router.add_post("/v1/completions", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0)
        sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 1, "stop": ["\n"]}
        messages: list = [{"role": "user", "content": "3+4="}]
        reply = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR], **sampling)
        message = reply.choices[0].message
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "7"}]
        await client.chat.completions.create(model="m", messages=messages, n=2, seed=3, logprobs=True, **sampling)
        await client.chat.completions.create(model="m", messages=messages, max_completion_tokens=4, tool_choice="none")
        await client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=2, logprobs=0, n=2, seed=1)
    finally:
        await runner.cleanup()
    return seen


CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}


def test_the_clients_bodies_validate_in_sglang_and_in_hpcrl(sglang):
    bodies = asyncio.run(asyncio.wait_for(bodies_the_client_sends(), 60))
    assert [path for path, _ in bodies] == ["/v1/chat/completions"] * 3 + ["/v1/completions"]
    for path, body in bodies:
        if path == "/v1/completions":
            sglang.CompletionRequest.model_validate(body)
            assert protocol.parse_completion(body).sampling.n == 2
        else:
            sglang.ChatCompletionRequest.model_validate(body)
            protocol.parse_chat(body)


def test_the_routes_exist_in_sglang(wheel):
    routes = wheel.routes()
    assert "GET" in routes["/v1/models"]["methods"]
    assert "GET" in routes["/v1/models/{model:path}"]["methods"]
    assert "POST" in routes["/v1/completions"]["methods"]
    assert "POST" in routes["/v1/chat/completions"]["methods"]
    source = wheel.source("srt/entrypoints/http_server.py")  # each takes its request class as the body
    assert "async def openai_v1_completions(request: CompletionRequest" in source
    assert "async def openai_v1_chat_completions(\n    request: ChatCompletionRequest" in source
