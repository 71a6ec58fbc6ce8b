"""A sample whose server answers "abort" with no new token while generation is not paused fails after
``rollout.max_empty_aborts`` tries, naming the server and the abort's message, and its group counts as failed;
a weight update's aborts (``resumed`` cleared) never count, and any new token starts the count again."""

import asyncio
from contextlib import asynccontextmanager

import openai
import pytest
from aiohttp import web

from hpcrl.config import ConfigError
from hpcrl.controller.loop import _episode_error_cause
from hpcrl.inference.client import GenerateResult, InferenceClient, InferenceError
from hpcrl.inference.openai.chat import ChatFormat
from hpcrl.models.tiny import make_tokenizer
from hpcrl.reward.outcome import RewardOutcome
from hpcrl.rollout.executor import RolloutExecutor, RolloutStalled
from hpcrl.rollout.proxy.server import Proxy
from hpcrl.rollout.workflows import close_workflow, make_workflow
from hpcrl.rollout.workflows.single_turn import NoProgress, SingleTurn
from tests.config.compose import load

SAMPLING = {"max_new_tokens": 4, "temperature": 1.0}
WHY = "scheduler refused the request"  # the fake server's abort message


class AlwaysAborts:
    """An HTTP server speaking SGLang's /generate that answers every prompt aborted with no token; it records
    each request's prompts."""

    def __init__(self):
        self.requests: list[list[list[int]]] = []
        self.address = ""

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        batch = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batch else [body["input_ids"]]
        self.requests.append(prompts)
        answers = [self.answer(len(prompt)) for prompt in prompts]
        return web.json_response(answers if batch else answers[0])

    @staticmethod
    def answer(prompt_tokens: int) -> dict:
        meta = {
            "id": "x",
            "finish_reason": {"type": "abort", "message": WHY},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "weight_version": "default",
            "output_token_logprobs": [],
        }
        return {"text": "", "output_ids": [], "meta_info": meta}


@asynccontextmanager
async def always_aborting():
    server = AlwaysAborts()
    app = web.Application()
    app.router.add_post("/generate", server.generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.address = f"127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield server
    finally:
        await runner.cleanup()


def run(coro):
    # without the bound the sample is resubmitted forever: the deadline turns that into a failure
    return asyncio.run(asyncio.wait_for(coro, 30))


def resumed_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


class Zero:
    async def score(self, items):
        return [RewardOutcome(0.0) for _ in items]


def assert_names_server_and_cause(error: BaseException, server: str, tries: int):
    assert isinstance(error, NoProgress) and isinstance(error, InferenceError)
    assert error.server == server and error.endpoint == "/generate"
    assert f"POST /generate on {server} answered a sample aborted with no new token {tries} times" in str(error)
    assert f"(rollout.max_empty_aborts={tries}); the abort's message: {WHY!r}" in str(error)


def test_a_sample_a_server_always_aborts_fails_after_the_bound_naming_the_server_and_its_message():
    async def body():
        async with always_aborting() as server, InferenceClient([server.address]) as client:
            single = SingleTurn(client, make_tokenizer(), SAMPLING, 1, Zero(), resumed_event(), max_empty_aborts=3)
            with pytest.raises(NoProgress) as failed:
                await single.sample([4, 5], seed=1)
            return server, failed.value

    server, error = run(body())
    assert server.requests == [[[4, 5]]] * 3, "the bound's tries, each from the prompt (no token came)"
    assert_names_server_and_cause(error, server.address, 3)
    assert _episode_error_cause(error) == "failed", "counted as a failed group, like a request the retries lost"


def test_groups_a_server_always_aborts_are_rejected_and_counted_as_failed():
    """Through the executor, as the controller runs episodes: each group fails after the bound (one batched
    request of the group's samples per try), is counted as ``failed``, and too many in a row stall the run."""

    async def body():
        async with always_aborting() as server, InferenceClient([server.address]) as client:
            workflow = SingleTurn(client, make_tokenizer(), SAMPLING, 2, Zero(), resumed_event(), max_empty_aborts=4)
            rows = iter(lambda: ("1+1=", "2"), None)
            executor = RolloutExecutor(
                lambda row: workflow.run(*row), rows, batch_size=1, max_concurrent=1, max_staleness=0,
                classify=_episode_error_cause, max_rejected_in_a_row=2,
            )  # fmt: skip
            executor.start()
            try:
                with pytest.raises(RolloutStalled) as stalled:
                    await executor.next_batch()
            finally:
                await executor.close()
            return server, executor, str(stalled.value)

    server, executor, message = run(body())
    assert [len(prompts) for prompts in server.requests] == [2] * 8, "2 groups, 4 tries each, of both samples"
    assert executor.rejected["failed"] == 2 and executor.rejected_total == 2
    assert "0 too long, 2 failed" in message and f"(last: NoProgress: POST /generate on {server.address}" in message
    assert "rollout.max_empty_aborts times in a row: see the servers' logs" in message, "what to look at"


@pytest.mark.parametrize(
    ("overrides", "group_size"),
    [
        ([], 2),  # single_turn: the group's samples in one batched request per try
        (["workflow.name=multi_turn"], 1),
        (["workflow.name=best_of_n", "workflow.n=2"], 1),  # n=1 below: one candidate, so the tries are counted
        (["experiment=mod10_agent"], 1),
    ],
    ids=["single_turn", "multi_turn", "best_of_n", "agent"],
)
def test_every_workflow_takes_the_bound_from_the_config(overrides, group_size):
    """``rollout.max_empty_aborts`` reaches every workflow ``make_workflow`` builds, the agent's proxy included."""
    tries = 3
    cfg = load(*overrides, f"rollout.max_empty_aborts={tries}")
    # one sample (one candidate) at a time: concurrent ones would go on trying while the first one fails
    cfg.algorithm.group_size, cfg.workflow.n = group_size, 1

    async def body():
        async with always_aborting() as server, InferenceClient([server.address]) as client:
            workflow = make_workflow(cfg, client, make_tokenizer(), Zero(), resumed_event())
            try:
                with pytest.raises(InferenceError) as failed:
                    await workflow.run("1+1=", "2", seed=3)
            finally:
                await close_workflow(workflow)
            return server, failed.value

    server, error = run(body())
    assert len(server.requests) == tries
    assert_names_server_and_cause(error, server.address, tries)


def test_the_agent_proxy_answers_a_502_naming_the_server_and_keeps_the_error_on_the_episode():
    tokenizer = make_tokenizer()

    async def body():
        async with always_aborting() as server, InferenceClient([server.address]) as client:
            proxy = Proxy(client, tokenizer, ChatFormat(tokenizer), resumed_event(), max_empty_aborts=2)
            await proxy.start()
            try:
                log = proxy.open(SAMPLING)
                agent = openai.AsyncOpenAI(base_url=proxy.base_url(log), api_key="any", max_retries=0)
                with pytest.raises(openai.InternalServerError) as failed:
                    await agent.completions.create(model="m", prompt="1+1=", n=2)
            finally:
                await proxy.close()
            return server, failed.value, log

    server, error, log = run(body())
    assert len(server.requests) == 2 * 2, "each of the n=2 choices tried twice"
    assert error.status_code == 502 and server.address in error.message and WHY in error.message
    assert_names_server_and_cause(log.error, server.address, 2)
    assert log.completions == []


class Scripted:
    """A client whose answers follow ``script``: (tokens, reason, paused) per request, where ``paused`` answers
    as a weight update does: it clears ``resumed`` and sets it again soon after."""

    def __init__(self, script: list[tuple[int, str, bool]], resumed: asyncio.Event):
        self.script, self.resumed, self.sent = list(script), resumed, 0

    async def generate(self, input_ids, sampling_params, **kwargs):
        tokens, reason, paused = self.script[self.sent]
        self.sent += 1
        if paused:
            self.resumed.clear()
            asyncio.get_running_loop().call_later(0.01, self.resumed.set)
        return GenerateResult([7] * tokens, [-1.0] * tokens, reason, "1", "fake:1", {"finish_reason": {"type": reason}})


def sample_by(script: list[tuple[int, str, bool]], bound: int = 3) -> tuple[Scripted, object]:
    async def body():
        resumed = resumed_event()
        client = Scripted(script, resumed)
        single = SingleTurn(client, make_tokenizer(), {**SAMPLING, "max_new_tokens": 8}, 1, Zero(), resumed,  # type: ignore[arg-type]
                            max_empty_aborts=bound)  # fmt: skip
        try:
            return client, await single.sample([4, 5])
        except NoProgress as e:
            return client, e

    return run(body())


EMPTY, PAUSED, ONE = (0, "abort", False), (0, "abort", True), (1, "abort", False)


@pytest.mark.parametrize(
    "script",
    [
        [PAUSED] * 10 + [(8, "length", False)],  # a weight update's aborts, many in a row
        [
            EMPTY,
            EMPTY,
            ONE,
            EMPTY,
            EMPTY,
            ONE,
            PAUSED,
            EMPTY,
            EMPTY,
            (6, "length", False),
        ],  # a token restarts the count
        [ONE] * 7 + [(1, "length", False)],  # an abort after every token: each one is progress
    ],
    ids=["paused", "restarted-by-a-token", "a-token-each-time"],
)
def test_aborts_of_a_weight_update_or_with_progress_never_fail_the_sample(script):
    client, sample = sample_by(script)
    assert not isinstance(sample, Exception), sample
    assert client.sent == len(script), "every abort resubmitted"
    assert len(sample.output_ids) == 8 and sample.finish_reason == "length"


def test_an_interrupted_sample_that_reached_the_context_margin_ends_as_length_not_refused():
    # prompt 2 + 5 tokens = 7 = max_input_len(13): SGLang refuses that as a prompt, so the sample cannot go on;
    # before, the client refused the resubmission (ContextLengthError) and its group counted as too long
    async def body():
        resumed = resumed_event()
        client = Scripted([(5, "abort", True), (3, "length", False)], resumed)
        client.context_length = 13
        single = SingleTurn(client, make_tokenizer(), {**SAMPLING, "max_new_tokens": 8}, 1, Zero(), resumed)  # type: ignore[arg-type]
        return client, await single.sample([4, 5])

    client, sample = run(body())
    assert client.sent == 1 and len(sample.output_ids) == 5 and sample.finish_reason == "length"


def test_a_weight_updates_aborts_neither_count_nor_restart_the_count():
    client, error = sample_by([EMPTY, EMPTY, PAUSED, PAUSED, EMPTY, (8, "length", False)])
    assert isinstance(error, NoProgress) and client.sent == 5, "the third empty abort outside an update fails it"
    assert "3 times in a row" in str(error) and "fake:1" in str(error) and "the abort's message: None" in str(error)


def test_the_bound_is_checked():
    with pytest.raises(ValueError, match="max_empty_aborts must be >= 1, got 0"):
        SingleTurn(None, make_tokenizer(), SAMPLING, 1, Zero(), resumed_event(), max_empty_aborts=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as refused:
        load("rollout.max_empty_aborts=0")
    assert str(refused.value) == "rollout.max_empty_aborts=0 is invalid: expected an integer >= 1"
