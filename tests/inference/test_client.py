"""The inference client's generate path: request shape, parsing, retries, timeouts and server choice.

Each test runs fake SGLang-like servers (tests/inference/test_client_fakes.py) on real loopback sockets.
"""

import asyncio

import pytest

from hpcrl.inference.client import ContextLengthError, GenerateResult, InferenceClient, InferenceError
from hpcrl.net import has_ipv6
from tests.inference.test_client_fakes import HOLD, closed_port_address, fake_servers, run, wait_for_requests

PARAMS = {"max_new_tokens": 3, "temperature": 1.0}
FAST = {"backoff_s": 0.01}  # retries without real waiting


def test_generate_sends_sglang_request_and_parses_answer():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address]) as client:
            result = await client.generate([5, 6], PARAMS, rid="r1")
            assert fake.bodies("/generate") == [
                {"input_ids": [5, 6], "sampling_params": PARAMS, "return_logprob": True, "rid": "r1"}
            ]
            assert result == GenerateResult(
                output_ids=[7, 8, 9],
                logprobs=[-0.5, -1.0, -1.5],
                finish_reason="length",
                weight_version="3",
                server=fake.address,
                meta_info=result.meta_info,
            )
            assert result.meta_info["completion_tokens"] == 3
            assert client.in_flight == {fake.address: 0}

            fake.finish_reason = {"type": "abort", "message": "paused"}
            result = await client.generate([5], PARAMS, return_logprob=False)
            assert (result.finish_reason, result.logprobs) == ("abort", [])
            assert "rid" not in fake.bodies("/generate")[-1]

    run(body())


def test_generate_many_sends_one_batch_and_keeps_prompt_order():
    async def body():
        async with fake_servers(2) as fakes, InferenceClient([f.address for f in fakes]) as client:
            results = await client.generate_many([[1], [10], [20]], PARAMS)
            assert [r.output_ids[0] for r in results] == [2, 11, 21]
            assert sum(len(f.bodies("/generate")) for f in fakes) == 1

    run(body())


def test_missing_max_new_tokens_is_refused_before_sending():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address]) as client:
            with pytest.raises(ValueError, match="max_new_tokens"):
                await client.generate([1], {"temperature": 0.7})
            with pytest.raises(ValueError, match="n=4"):
                await client.generate([1], {"max_new_tokens": 2, "n": 4})
            assert fake.requests == []

    run(body())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "random"}, "policy must be one of least_loaded, round_robin, got 'random'"),
        ({"addresses": []}, "non-empty list"),
        ({"addresses": ["node1"]}, "the port is missing"),
        ({"addresses": ["a:1", "a:1"]}, "must not repeat"),
        ({"request_timeout_s": 0}, "request_timeout_s must be > 0"),
        ({"max_retries": -1}, "max_retries must be >= 0"),
        ({"tp_size": 0}, "tp_size must be an integer >= 1"),
        ({"weight_update_timeout_s": 0}, "weight_update_timeout_s must be > 0"),
        ({"context_overflow": "cut"}, "context_overflow must be one of drop, truncate, got 'cut'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InferenceClient(**{"addresses": ["127.0.0.1:1"], **kwargs})


def test_use_outside_async_with_says_how_to_open_it():
    client = InferenceClient(["127.0.0.1:1"])
    with pytest.raises(RuntimeError, match="async with"):
        run(client.generate([1], PARAMS))


def test_retries_http_503_then_succeeds():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address], max_retries=3, **FAST) as client:
            fake.fail_next = [503, 503]
            result = await client.generate([1], PARAMS)
            assert result.output_ids == [2, 3, 4]
            assert len(fake.bodies("/generate")) == 3

    run(body())


def test_retry_moves_to_another_server():
    async def body():
        async with fake_servers(2) as [bad, good]:
            bad.fail_next = [503] * 10
            async with InferenceClient([bad.address, good.address], **FAST) as client:
                result = await client.generate([1], PARAMS)
            assert result.server == good.address
            assert len(bad.bodies("/generate")) == 1

    run(body())


def test_gives_up_after_max_retries_naming_server_endpoint_and_attempts():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address], max_retries=2, **FAST) as client:
            fake.fail_next = [500] * 10
            with pytest.raises(InferenceError) as caught:
                await client.generate([1], PARAMS)
            message = str(caught.value)
            assert fake.address in message and "/generate" in message and "3 attempt(s)" in message
            assert "HTTP 500: fake error 500" in message
            assert caught.value.server == fake.address
            assert len(fake.bodies("/generate")) == 3

    run(body())


def test_http_400_is_not_retried_and_carries_the_server_body():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address], **FAST) as client:
            fake.fail_next = [400]
            with pytest.raises(InferenceError, match=r"HTTP 400.*fake error 400 on /generate") as caught:
                await client.generate([1], PARAMS)
            assert (caught.value.server, caught.value.status) == (fake.address, 400)
            assert len(fake.bodies("/generate")) == 1

    run(body())


def test_connection_refused_fails_fast_naming_the_address():
    address = closed_port_address()

    async def body():
        async with InferenceClient([address], max_retries=2, **FAST) as client:
            with pytest.raises(InferenceError, match="3 attempt") as caught:
                await client.generate([1], PARAMS)
            assert caught.value.server == address and address in str(caught.value)

    run(body(), timeout_s=5.0)


def test_server_that_never_answers_times_out_without_retry():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address], request_timeout_s=0.3) as client:
            fake.hang = True
            with pytest.raises(InferenceError, match=r"no answer within the 0\.3 s timeout") as caught:
                await client.generate([1], PARAMS)
            assert caught.value.server == fake.address and fake.address in str(caught.value)
            assert len(fake.bodies("/generate")) == 1
            assert client.in_flight == {fake.address: 0}

    run(body())


def test_malformed_logprobs_are_an_error_not_silently_misaligned():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address]) as client:
            fake.logprob_shift = 1
            with pytest.raises(InferenceError, match="do not match"):
                await client.generate([1], PARAMS)

    run(body())


def test_least_loaded_sends_new_work_away_from_a_busy_server():
    async def body():
        async with fake_servers(2) as fakes, InferenceClient([f.address for f in fakes]) as client:
            held = asyncio.create_task(client.generate([1], PARAMS, rid=HOLD))
            await wait_for_requests(fakes, "/generate", 1)
            busy = next(f for f in fakes if f.bodies("/generate"))
            idle = next(f for f in fakes if f is not busy)
            assert client.in_flight == {busy.address: 1, idle.address: 0}
            servers = [(await client.generate([1], PARAMS)).server for _ in range(4)]
            assert servers == [idle.address] * 4
            busy.release.set()
            assert (await held).server == busy.address

    run(body())


def test_least_loaded_balances_concurrent_requests():
    async def body():
        async with fake_servers(3) as fakes, InferenceClient([f.address for f in fakes]) as client:
            tasks = [asyncio.create_task(client.generate([i], PARAMS, rid=HOLD)) for i in range(12)]
            await wait_for_requests(fakes, "/generate", 12)
            assert client.in_flight == {f.address: 4 for f in fakes}
            assert [len(f.bodies("/generate")) for f in fakes] == [4, 4, 4]
            for fake in fakes:
                fake.release.set()
            await asyncio.gather(*tasks)
            assert client.in_flight == {f.address: 0 for f in fakes}

    run(body())


def test_round_robin_alternates_even_when_one_server_is_busy():
    async def body():
        async with fake_servers(2) as [a, b], InferenceClient([a.address, b.address], policy="round_robin") as client:
            held = asyncio.create_task(client.generate([1], PARAMS, rid=HOLD))  # goes to a
            await wait_for_requests([a], "/generate", 1)
            servers = [(await client.generate([1], PARAMS)).server for _ in range(4)]
            assert servers == [b.address, a.address, b.address, a.address]
            a.release.set()
            await held

    run(body())


def test_explicit_server_is_used_and_must_be_known():
    async def body():
        async with fake_servers(2) as [a, b], InferenceClient([a.address, b.address]) as client:
            assert {(await client.generate([1], PARAMS, server=b.address)).server for _ in range(3)} == {b.address}
            with pytest.raises(ValueError, match="not one of this client's servers"):
                await client.generate([1], PARAMS, server="127.0.0.1:9")

    run(body())


@pytest.mark.skipif(not has_ipv6(), reason="this machine cannot bind ::1")
def test_ipv6_bracketed_address_works():
    async def body():
        async with fake_servers(1, host="::1") as [fake], InferenceClient([fake.address]) as client:
            assert fake.address.startswith("[::1]:")
            await client.wait_healthy(timeout_s=5)
            assert (await client.generate([1], PARAMS)).server == fake.address

    run(body())


def test_a_prompt_over_the_context_length_is_refused_before_it_is_sent():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address], context_length=16) as client:
            with pytest.raises(
                ContextLengthError, match=r"12 tokens with max_new_tokens=5 \(17 tokens\) does not fit"
            ) as e:
                await client.generate([1] * 12, {"max_new_tokens": 5})
            assert (e.value.prompt_tokens, e.value.max_new_tokens, e.value.context_length) == (12, 5, 16)
            assert isinstance(e.value, InferenceError)  # the executor's failure policy applies to it too
            with pytest.raises(ContextLengthError):
                await client.generate_many([[1] * 4, [1] * 16], {"max_new_tokens": 1})
            with pytest.raises(ContextLengthError, match=r"SGLang takes prompts of at most 9 tokens"):
                await client.generate([1] * 10, {"max_new_tokens": 1})  # within SGLang's margin: 16 - 1 - 5
            assert fake.requests == [], "nothing over the context may reach a server: SGLang answers HTTP 400"
            await client.generate([1] * 9, {"max_new_tokens": 7})  # the longest prompt, exactly the context
            assert fake.bodies("/generate")[0]["sampling_params"] == {"max_new_tokens": 7}

    run(body())


def test_context_overflow_truncate_sends_fewer_new_tokens_when_the_prompt_leaves_room():
    async def body():
        options = {"context_length": 16, "context_overflow": "truncate"}
        async with fake_servers(1) as [fake], InferenceClient([fake.address], **options) as client:
            result = await client.generate([1] * 9, {"max_new_tokens": 10, "temperature": 1.0})
            assert len(result.output_ids) == 7
            assert fake.bodies("/generate")[0]["sampling_params"] == {"max_new_tokens": 7, "temperature": 1.0}
            await client.generate_many([[1] * 2, [1] * 8], {"max_new_tokens": 10})
            assert fake.bodies("/generate")[1]["sampling_params"] == [{"max_new_tokens": 10}, {"max_new_tokens": 8}]
            for prompt in (16, 10):  # one that fills the context; one within SGLang's margin, which refuses it
                with pytest.raises(ContextLengthError):
                    await client.generate([1] * prompt, {"max_new_tokens": 1})
            assert len(fake.bodies("/generate")) == 2

    run(body())
