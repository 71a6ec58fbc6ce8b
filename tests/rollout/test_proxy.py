"""The per-episode OpenAI proxy, driven by the real ``openai`` client as an agent drives it, in front of a real CPU
server through hpcrl's InferenceClient: the answers are OpenAI's wire format, and what the proxy records of each
completion (prompt ids, output ids, logprobs, weight versions) is exactly what the server generates for the same
ids and seed on its own ``/generate``. What it cannot honour is a 400 in OpenAI's error shape, naming the field."""

import asyncio
from contextlib import asynccontextmanager

import openai
import pytest

from hpcrl.inference.client import ContextLengthError, GenerateResult, InferenceClient, InferenceError
from hpcrl.inference.openai.chat import ChatFormat
from hpcrl.models.tiny import make_tokenizer
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.net import PortAllocator, has_ipv6
from hpcrl.rollout.agents.mod10 import CALCULATOR
from hpcrl.rollout.proxy.server import MODEL, Proxy, loopback
from hpcrl.rollout.workflows.base import derive_seed, version_number
from tests.inference.conftest import free_port
from tests.rollout.test_multi_turn import resumed_event, run

# the episode's sampling parameters (SGLang's names); 0.7, not a default, so a request drawn at another shows
EPISODE = {"max_new_tokens": 4, "temperature": 0.7, "top_p": 1.0, "top_k": -1}
EPISODE_SEED = 7
NO_EOS = {"ignore_eos": True}  # every answer has its full max_tokens: the lengths are known


@asynccontextmanager
async def proxy_on(addresses, tokenizer, chat=None, **client_options):
    """A started proxy whose client talks to ``addresses``; ``chat`` defaults to tiny_tools with the tiny parser."""
    chat = chat or ChatFormat(tokenizer, "tiny_tools", "tiny")
    async with InferenceClient(addresses, max_retries=0, **client_options) as client:
        proxy = Proxy(client, tokenizer, chat, resumed_event())
        await proxy.start()
        try:
            yield proxy
        finally:
            await proxy.close()


def agent_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="any", max_retries=0)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def draw_seed(request: int, choice: int = 0, request_seed: int | None = None) -> int:
    """The sampling seed of a choice's first /generate: from the request's seed, else the episode's and the
    request's place in the episode (records.EpisodeLog.request_seed, then SingleTurn.sample's first part)."""
    if request_seed is not None:
        return derive_seed(derive_seed(request_seed, "choice", choice), 0)
    return derive_seed(derive_seed(EPISODE_SEED, "request", request, "choice", choice), 0)


def server_draw(server, prompt_ids, seed, **params) -> tuple[list[int], list[float], int]:
    """What the server's own /generate gives for these ids, the episode's sampling and ``seed``."""
    sampling = {**EPISODE, "sampling_seed": seed, **params}
    status, answer = server.post(
        "/generate", {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True}
    )
    assert status == 200, answer
    meta = answer["meta_info"]
    return answer["output_ids"], [e[0] for e in meta["output_token_logprobs"]], version_number(meta["weight_version"])


def assert_recorded(completion, server, prompt_ids, seed, **params):
    """The completion is exactly the server's draw for its prompt and seed."""
    output_ids, logprobs, version = server_draw(server, prompt_ids, seed, **params)
    assert completion.prompt_ids == prompt_ids
    assert completion.output_ids == output_ids
    assert completion.logprobs == pytest.approx(logprobs, abs=1e-5)
    assert completion.versions == [version] * len(output_ids)


def test_a_chat_answer_is_the_servers_draw_recorded_token_for_token(agent_server):
    tokenizer = load_tokenizer(agent_server.model)

    async def episode():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open(EPISODE, EPISODE_SEED)
            reply = await agent_client(proxy.base_url(log)).chat.completions.create(
                model="anything", messages=[{"role": "user", "content": "3+4="}], logprobs=True, extra_body=NO_EOS
            )
            return reply, log

    reply, log = run(episode())
    [recorded] = log.completions
    prompt_ids = ids(tokenizer, "3+4=")  # tiny_tools writes a user turn as its bare text
    assert_recorded(recorded, agent_server, prompt_ids, draw_seed(0), ignore_eos=True)
    assert (recorded.id, recorded.index, recorded.order, recorded.tool_calls) == (reply.id, 0, 0, 0)
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == recorded.text == tokenizer.decode(recorded.output_ids, skip_special_tokens=True)
    assert [t.logprob for t in choice.logprobs.content] == recorded.logprobs
    assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([t]) for t in recorded.output_ids]
    assert reply.object == "chat.completion" and reply.model == "anything" and reply.id.startswith("chatcmpl-")
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), EPISODE["max_new_tokens"])
    assert usage.total_tokens == len(prompt_ids) + EPISODE["max_new_tokens"]


def test_completions_take_text_or_ids_with_the_episodes_sampling_where_unset(agent_server):
    tokenizer = load_tokenizer(agent_server.model)

    async def episode():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open(EPISODE, EPISODE_SEED)
            c = agent_client(proxy.base_url(log))
            # no temperature nor max_tokens: the episode's 0.7 and 4, not /v1/completions' own 1.0 and 16
            text = await c.completions.create(model="m", prompt="3+4=", extra_body=NO_EOS)
            own = await c.completions.create(model="m", prompt=ids(tokenizer, "5+5="), max_tokens=2, logprobs=0, seed=3)
            return text, own, log

    text, own, log = run(episode())
    first, second = log.completions
    assert_recorded(first, agent_server, ids(tokenizer, "3+4="), draw_seed(0), ignore_eos=True)
    assert_recorded(second, agent_server, ids(tokenizer, "5+5="), draw_seed(1, request_seed=3), max_new_tokens=2)
    assert text.object == "text_completion" and text.choices[0].text == first.text
    assert text.usage.completion_tokens == len(first.output_ids) == EPISODE["max_new_tokens"]
    assert own.choices[0].logprobs.token_logprobs == second.logprobs
    assert own.usage.prompt_tokens == len(second.prompt_ids) == 4 and [c.order for c in log.completions] == [0, 1]


def test_n_choices_are_each_the_servers_draw_and_each_recorded(agent_server):
    tokenizer = load_tokenizer(agent_server.model)
    messages = [{"role": "user", "content": "2+9="}]

    async def episode():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open(EPISODE, EPISODE_SEED)
            ask = {"model": "m", "messages": messages, "n": 3, "seed": 11, "max_completion_tokens": 3}
            return await agent_client(proxy.base_url(log)).chat.completions.create(**ask, extra_body=NO_EOS), log

    reply, log = run(episode())
    prompt_ids = ids(tokenizer, "2+9=")
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [(c.id, c.index) for c in log.completions] == [(reply.id, 0), (reply.id, 1), (reply.id, 2)]
    for k, (choice, recorded) in enumerate(zip(reply.choices, log.completions, strict=True)):
        assert_recorded(
            recorded, agent_server, prompt_ids, draw_seed(0, k, request_seed=11), max_new_tokens=3, ignore_eos=True
        )
        assert choice.message.content == recorded.text
    assert len({tuple(c.output_ids) for c in log.completions}) > 1, "each choice is a draw of its own"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 9)  # the prompt counts once


def test_models_names_the_policy_and_its_context(agent_server):
    tokenizer = load_tokenizer(agent_server.model)

    async def episode():
        async with proxy_on([agent_server.address], tokenizer, context_length=512) as proxy:
            return await agent_client(proxy.base_url(proxy.open(EPISODE))).models.list()

    listed = run(episode())
    assert [(m.id, m.max_model_len) for m in listed.data] == [(MODEL, 512)]


def call_draw(server, tokenizer) -> tuple[str, int]:
    """A question and a request seed whose one-token draw at the episode's temperature is the tiny call ``?``."""
    questions = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    for seed in range(8):
        sampling = {**EPISODE, "max_new_tokens": 1, "sampling_seed": draw_seed(0, request_seed=seed)}
        answers = server.generate_many(
            [{"input_ids": ids(tokenizer, q), "sampling_params": sampling} for q in questions]
        )
        calls = [q for q, answer in zip(questions, answers, strict=True) if answer["output_ids"] == ids(tokenizer, "?")]
        if calls:
            return calls[0], seed
    raise AssertionError("no question draws the call token with seeds 0..7; the agent model changed")


def test_a_tiny_tool_call_comes_back_as_tool_calls_and_its_result_extends_the_prompt(agent_server):
    tokenizer = load_tokenizer(agent_server.model)
    question, seed = call_draw(agent_server, tokenizer)
    messages = [{"role": "user", "content": question}]

    async def episode():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open(EPISODE, EPISODE_SEED)
            c = agent_client(proxy.base_url(log))
            reply = await c.chat.completions.create(
                model="m", messages=messages, tools=[CALCULATOR], seed=seed, max_tokens=1
            )
            call = reply.choices[0].message
            history = [*messages, call, {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "7"}]
            answer = await c.chat.completions.create(model="m", messages=history, max_tokens=1)
            return reply, answer, log

    reply, answer, log = run(episode())
    message = reply.choices[0].message
    [call] = message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "calculator", "{}")
    assert message.content == "" and reply.choices[0].finish_reason == "length"  # one token: cut, not stopped
    first, second = log.completions
    assert (first.output_ids, first.tool_calls, first.text) == (ids(tokenizer, "?"), 1, "")
    # tiny_tools wrote the call as "?" and the result as "7=": the prompt extends the first turn token for token
    assert second.prompt_ids == first.prompt_ids + first.output_ids + ids(tokenizer, "7=")
    assert_recorded(second, agent_server, ids(tokenizer, f"{question}?7="), draw_seed(1), max_new_tokens=1)
    assert answer.usage.prompt_tokens == len(second.prompt_ids) and second.tool_calls == 0  # no tools: no call


class Scripted:
    """A stand-in for InferenceClient: every generate answers ``output_ids`` (for the tool-call parser's logic)."""

    context_length = None

    def __init__(self, output_ids: list[int], finish_reason: str = "stop", version: str = "3"):
        self.output_ids, self.finish_reason, self.version = output_ids, finish_reason, version
        self.sent: list[list[int]] = []

    async def generate(self, input_ids, sampling_params, **kwargs) -> GenerateResult:
        self.sent.append(list(input_ids))
        n = len(self.output_ids)
        return GenerateResult(list(self.output_ids), [-0.5] * n, self.finish_reason, self.version, "scripted", {})


@pytest.mark.parametrize(
    ("turn", "content", "arguments"),
    [
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>',
            "",
            '{"expression": "3+4"}',
        ),
        ('I add.<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "I add.", "{}"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', None, None),  # no such tool: all content
    ],
)
def test_a_hermes_tool_call_is_parsed_from_the_generated_tokens_which_are_recorded_as_generated(
    turn, content, arguments
):
    tokenizer = make_tokenizer()
    generated = [*ids(tokenizer, turn), tokenizer.eos_token_id]  # the model's turn and its end-of-sequence token
    scripted = Scripted(generated)

    async def episode():
        proxy = Proxy(scripted, tokenizer, ChatFormat(tokenizer, "", "hermes"), resumed_event())  # type: ignore[arg-type]
        await proxy.start()
        try:
            log = proxy.open(EPISODE)
            messages = [{"role": "user", "content": "3+4="}]
            reply = await agent_client(proxy.base_url(log)).chat.completions.create(
                model="m", messages=messages, tools=[CALCULATOR]
            )
            return reply, log
        finally:
            await proxy.close()

    reply, log = run(episode())
    [choice] = reply.choices
    [recorded] = log.completions
    assert recorded.output_ids == generated and recorded.versions == [3] * len(generated), "the tokens, not the text"
    assert scripted.sent == [ids(tokenizer, "user: 3+4=\nassistant: ")]  # the tiny model's own chat template
    if arguments is not None:
        [call] = choice.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("calculator", arguments)
        assert choice.finish_reason == "tool_calls" and choice.message.content == content and recorded.tool_calls == 1
    else:
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None and recorded.tool_calls == 0
        assert choice.message.content == turn  # the end-of-sequence token is not shown


# --- what the proxy cannot honour ----------------------------------------------------------------------------

USER = [{"role": "user", "content": "3+4="}]


@pytest.mark.parametrize(
    ("ask", "param", "words"),
    [
        ({"temperature": 1.0}, "temperature", "temperature=1.0 is not this episode's 0.7"),
        ({"store": True}, "store", "unknown field 'store'"),
        ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty=0.5 is not supported"),
        ({"tool_choice": "required", "tools": [CALCULATOR]}, "tool_choice", "constrained decoding"),
        ({"tools": [CALCULATOR, {**CALCULATOR, "function": {"name": "other"}}]}, "tools", "one tool"),
        ({"messages": []}, "messages", "Messages cannot be empty."),
        # truncated sampling: the trainer's ratio is of the full distribution (before, trained with a wrong ratio)
        ({"top_p": 0.9}, "top_p", "top_p=0.9 is refused in a training episode"),
        ({"extra_body": {"top_k": 5}}, "top_k", "top_k=5 is refused in a training episode"),
    ],
)
def test_a_request_the_proxy_cannot_honour_is_a_400_in_openais_shape_and_records_nothing(
    agent_server, ask, param, words
):
    tokenizer = load_tokenizer(agent_server.model)

    async def episode():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open(EPISODE, EPISODE_SEED)
            with pytest.raises(openai.BadRequestError) as refused:
                await agent_client(proxy.base_url(log)).chat.completions.create(
                    **{"model": "m", "messages": USER, **ask}
                )
            return refused.value, log

    error, log = run(episode())
    assert error.status_code == 400 and words in error.body["message"], error.body
    assert error.body == {
        "message": error.body["message"],
        "type": "invalid_request_error",
        "param": param,
        "code": 400,
    }
    assert log.completions == [] and log.error is None


def test_a_greedy_evaluation_episode_may_ask_for_top_p_and_top_k(agent_server):
    # held-out evaluation samples greedily: truncation changes no token there, and nothing trains on it
    tokenizer = load_tokenizer(agent_server.model)

    async def episode():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open({**EPISODE, "temperature": 0.0}, EPISODE_SEED)
            return await agent_client(proxy.base_url(log)).chat.completions.create(
                model="m", messages=USER, top_p=0.5, extra_body={"top_k": 3}, max_tokens=2
            )

    answer = run(episode())
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_prompt_too_long_for_the_context_is_context_length_exceeded_kept_on_the_episode(agent_server):
    tokenizer = load_tokenizer(agent_server.model)

    async def episode():
        async with proxy_on([agent_server.address], tokenizer, context_length=16) as proxy:
            log = proxy.open(EPISODE, EPISODE_SEED)
            c = agent_client(proxy.base_url(log))
            with pytest.raises(openai.BadRequestError) as refused:  # 13 prompt tokens + 4 new > 16
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+2=3+4=5+6=7"}])
            # 9 tokens: the longest prompt SGLang takes in a context of 16 (16 - 1 - 5 - 1, its margin)
            fits = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+2=3+4=5"}])
            return refused.value, fits, log

    error, fits, log = run(episode())
    assert (error.status_code, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert "a prompt of 13 tokens with max_new_tokens=4 (17 tokens)" in error.message
    assert "context length of 16 tokens" in error.message
    assert isinstance(log.error, ContextLengthError), "kept, so the episode's failure is counted as too_long"
    assert [c.prompt_ids for c in log.completions] == [ids(tokenizer, "1+2=3+4=5")] and fits.usage.prompt_tokens == 9


def test_an_inference_failure_is_a_502_kept_on_the_episode(tmp_path):
    tokenizer = make_tokenizer()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def episode():
        async with proxy_on([dead], tokenizer, ChatFormat(tokenizer)) as proxy:
            log = proxy.open(EPISODE)
            with pytest.raises(openai.InternalServerError) as failed:
                await agent_client(proxy.base_url(log)).chat.completions.create(model="m", messages=USER)
            return failed.value, log

    error, log = run(episode())
    assert error.status_code == 502 and error.body["type"] == "server_error" and dead in error.message
    assert isinstance(log.error, InferenceError) and log.completions == []


def test_a_url_of_no_open_episode_is_a_404(agent_server):
    tokenizer = load_tokenizer(agent_server.model)

    async def refused(base_url: str) -> list[openai.NotFoundError]:
        c, errors = agent_client(base_url), []
        for call in (c.models.list(), c.completions.create(model="m", prompt="1")):
            with pytest.raises(openai.NotFoundError) as missing:
                await call
            errors.append(missing.value)
        return errors

    async def episode():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open(EPISODE)
            url = proxy.base_url(log)
            errors = await refused(url.replace(log.key, "0" * len(log.key)))  # not its URL
            proxy.close_episode(log)
            return errors + await refused(url), log  # an episode that ended: its URL answers no more

    errors, log = run(episode())
    assert len(errors) == 4 and all(e.status_code == 404 and "no open episode at /e/" in e.message for e in errors)
    assert errors[0].body["type"] == "invalid_request_error" and log.completions == [] and log.closed


def test_episodes_on_one_proxy_record_only_their_own_completions(agent_server):
    tokenizer = load_tokenizer(agent_server.model)

    async def episodes():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            logs = [proxy.open(EPISODE, seed) for seed in (1, 2)]
            asks = [
                agent_client(proxy.base_url(log)).completions.create(model="m", prompt=prompt, max_tokens=1)
                for log, prompt in zip(logs, ("1+1=", "2+2="), strict=True)
            ]
            await asyncio.gather(*asks)
            return logs

    first, second = run(episodes())
    assert [c.prompt_ids for c in first.completions] == [ids(tokenizer, "1+1=")]
    assert [c.prompt_ids for c in second.completions] == [ids(tokenizer, "2+2=")]


def test_the_episodes_stop_strings_end_an_answer_as_the_requests_own_do(agent_server):
    tokenizer = load_tokenizer(agent_server.model)
    draw = server_draw(agent_server, ids(tokenizer, "1+1="), draw_seed(0), ignore_eos=True)[0]
    stop = tokenizer.decode(draw, skip_special_tokens=True)[-1]  # a character the draw writes

    async def episode(episode_stop: list[str], request_stop: list[str]):
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open({**EPISODE, "stop": episode_stop}, EPISODE_SEED)
            c = agent_client(proxy.base_url(log))
            ask = {"model": "m", "prompt": "1+1=", "extra_body": NO_EOS}
            return await c.completions.create(**ask, **({"stop": request_stop} if request_stop else {})), log

    default, by_episode = run(episode([stop], []))
    own, by_request = run(episode([], [stop]))
    [recorded] = by_episode.completions
    assert recorded.output_ids == by_request.completions[0].output_ids, "the same draw, stopped at the same token"
    text = tokenizer.decode(recorded.output_ids, skip_special_tokens=True)
    assert text.endswith(stop) and default.choices[0].finish_reason == own.choices[0].finish_reason == "stop"
    assert default.choices[0].text == own.choices[0].text == text[: -len(stop)], "the stop string is not shown"


def test_a_request_in_flight_when_its_episode_ends_is_a_410_and_is_not_recorded(agent_server):
    tokenizer = load_tokenizer(agent_server.model)

    async def episode():
        async with proxy_on([agent_server.address], tokenizer) as proxy:
            log = proxy.open(EPISODE, EPISODE_SEED)
            ask = {"model": "m", "prompt": "3+4=", "max_tokens": 500, "extra_body": NO_EOS}  # a long generation
            request = asyncio.ensure_future(agent_client(proxy.base_url(log)).completions.create(**ask))
            for _ in range(500):  # until the proxy generates for it (a deadline: 5 s)
                if log.requests or request.done():  # its task alone may not have started yet: then nothing is in flight
                    break
                await asyncio.sleep(0.01)
            assert log.tasks and log.requests, "the request never reached the proxy's generation"
            proxy.close_episode(log)
            with pytest.raises(openai.APIStatusError) as ended:
                await request
            return ended.value, log

    error, log = run(episode())
    assert error.status_code == 410 and "the episode ended while this request was served" in error.message
    assert log.completions == [] and log.requests == 1


@pytest.mark.skipif(not has_ipv6(), reason="this machine cannot bind ::1")
def test_an_ipv6_runs_proxy_listens_on_its_loopback_at_a_port_of_its_slice(agent_server):
    tokenizer = load_tokenizer(agent_server.model)
    ports = PortAllocator(rank=3, world_size=8)

    async def episode():
        async with InferenceClient([agent_server.address], max_retries=0) as client:
            chat = ChatFormat(tokenizer, "tiny_tools", "tiny")
            proxy = Proxy(client, tokenizer, chat, resumed_event(), host=loopback("fd00::17"), ports=ports)
            await proxy.start()
            try:
                log = proxy.open(EPISODE, EPISODE_SEED)
                reply = await agent_client(proxy.base_url(log)).completions.create(model="m", prompt="3+4=")
                with pytest.raises(OSError):  # not on the IPv4 loopback, nor on any other address
                    await asyncio.open_connection("127.0.0.1", proxy.port)
                return proxy.base_url(log), proxy.port, reply, log
            finally:
                await proxy.close()

    url, port, reply, log = run(episode())
    low, high = ports.slice
    assert url == f"http://[::1]:{port}/e/{log.key}/v1" and low <= port < high
    assert [c.text for c in log.completions] == [reply.choices[0].text] and len(log.key) == 32
