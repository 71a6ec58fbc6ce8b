"""The CPU server's OpenAI routes driven by the real ``openai`` client, as an agent or eval script written for
SGLang's OpenAI-compatible server drives them: the answers are the same tokens ``/generate`` gives for the
prompt the chat template makes, and what the server cannot honour is SGLang's 400."""

import asyncio
import json
import urllib.request

import openai
import pytest

from hpcrl.models.tiny import make_tiny_model
from hpcrl.models.tokenizer import load_tokenizer
from tests.inference.conftest import ServerProc

TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}
ALPHABET = "0123456789+=?"


def client(server: ServerProc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A tiny model with the agent alphabet, served with the tiny_tools template and the tiny tool parser."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-tools"), characters=ALPHABET, seed=3)
    proc = ServerProc(
        model, tmp_path_factory.mktemp("tool-server") / "server.log", "127.0.0.1",
        "--chat-template", "tiny_tools", "--tool-call-parser", "tiny", "--served-model-name", "tiny",
    )  # fmt: skip
    yield proc
    proc.stop()


def generate(server: ServerProc, ids: list[int], seed: int, max_new_tokens: int) -> list[int]:
    params = {"max_new_tokens": max_new_tokens, "sampling_seed": seed, "temperature": 1.0}
    status, answer = server.post("/generate", {"input_ids": ids, "sampling_params": params})
    assert status == 200, answer
    return answer["output_ids"]


def test_models_lists_the_served_model(server, tool_server):
    listed = run(client(server).models.list())
    assert [m.id for m in listed.data] == [str(server.model)] and listed.data[0].max_model_len == 512
    assert run(client(tool_server).models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError):
        run(client(tool_server).models.retrieve("gpt-4o"))


def test_a_chat_answer_is_what_generate_gives_for_the_templated_prompt(server):
    tokenizer = load_tokenizer(server.model)
    messages = [{"role": "user", "content": "3+4="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply = run(
        client(server).chat.completions.create(
            model="any", messages=messages, max_tokens=5, seed=11, logprobs=True, extra_body={"ignore_eos": True}
        )
    )
    expected = generate(server, ids, seed=11, max_new_tokens=5)
    choice = reply.choices[0]
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([t]) for t in expected]
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 5)
    assert choice.finish_reason == "length" and reply.model == "any"


def test_completions_take_n_seeds_and_logprobs(server):
    tokenizer = load_tokenizer(server.model)
    ids = tokenizer("3+4=", add_special_tokens=False)["input_ids"]

    async def twice():
        c = client(server)
        ask = {"model": "m", "prompt": ids, "max_tokens": 4, "n": 2, "seed": 5, "logprobs": 0}
        return [await c.completions.create(**ask) for _ in "ab"]

    first, again = run(twice())
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: the same draws
    assert [c.index for c in first.choices] == [0, 1]
    assert first.choices[0].text == tokenizer.decode(generate(server, ids, 5, 4), skip_special_tokens=True)
    assert first.choices[1].text == tokenizer.decode(generate(server, ids, 6, 4), skip_special_tokens=True)
    assert len(first.choices[0].logprobs.token_logprobs) == len(first.choices[0].logprobs.tokens)
    assert first.usage.prompt_tokens == len(ids)  # once for its two answers


def test_a_tool_call_comes_back_as_tool_calls(tool_server):
    tokenizer = load_tokenizer(tool_server.model)
    ids = tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    call = tokenizer.convert_tokens_to_ids("?")
    seed = next(s for s in range(2000) if generate(tool_server, ids, s, 1) == [call])  # a draw of the call token
    messages = [{"role": "user", "content": "3+4="}]

    async def exchange():
        c = client(tool_server)
        ask = {"model": "tiny", "max_tokens": 1}
        reply = await c.chat.completions.create(messages=messages, tools=[TOOL], seed=seed, **ask)
        plain = await c.chat.completions.create(messages=messages, seed=seed, **ask)
        message = reply.choices[0].message
        history = [*messages, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "7"}]
        return reply, plain, await c.chat.completions.create(messages=history, **ask)

    reply, plain, answer = run(exchange())
    message = reply.choices[0].message
    assert message.content == "" and message.tool_calls[0].function.name == "calculator"
    assert reply.choices[0].finish_reason == "length"  # one token, the call: SGLang says tool_calls only for a stop
    assert plain.choices[0].message.content == "?" and plain.choices[0].message.tool_calls is None  # no tools
    assert answer.usage.prompt_tokens == len("3+4=?7=")  # tiny_tools rendered the call and its result


def post_raw(server: ServerProc, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.url}{path}", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"stream": True}, "stream=true is not supported"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"tool_choice": "required", "tools": [TOOL]}, "constrained decoding"),
        ({"messages": []}, "Messages cannot be empty."),
        ({"max_tokens": 513}, "max_completion_tokens is too large: 513"),
        ({"max_tokens": 510, "messages": [{"role": "user", "content": "x" * 40}]}, "maximum context length of 512"),
        ({"store": True}, "unknown field 'store'"),
    ],
)
def test_what_the_server_cannot_honour_is_sglangs_400(server, body, words):
    full = {"messages": [{"role": "user", "content": "a"}]} | body
    status, answer = post_raw(server, "/v1/chat/completions", json.dumps(full).encode())
    assert status == 400 and words in answer["message"], answer
    assert answer["object"] == "error" and answer["code"] == 400 and answer["type"] == "BadRequest"


def test_a_body_that_is_not_json_is_refused(server):
    status, answer = post_raw(server, "/v1/completions", b'{"prompt": "a"}', content_type="text/plain")
    assert status == 400 and "application/json" in answer["message"]
    status, answer = post_raw(server, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in answer["message"]


def test_the_openai_client_raises_bad_request_with_the_servers_message(server):
    messages = [{"role": "user", "content": "a"}]
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        run(client(server).chat.completions.create(model="m", messages=messages, frequency_penalty=1))
