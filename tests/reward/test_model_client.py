"""The reward-model client against a fake reward-model server on a real socket: calls of one tick coalesced into one
batched request per route and settings, round-robin over servers, failures naming the server, the deadline, the
time waited, and the bodies checked against SGLang 0.5.23's own request classes."""

import asyncio
import time

import pytest

from hpcrl.reward.model_client import InferenceError, RewardModelClient
from tests.inference.sglang_wheel import Wheel, fetch_wheel
from tests.inference.test_client_fakes import closed_port_address, run
from tests.reward.fake_reward_model import fake_reward_models

TEXTS = ["1+1=2ok", "1+1=3", "2+2=4ok", "9+9=1"]


def test_calls_of_one_tick_go_as_one_batched_request_per_route_and_settings():
    async def drive():
        async with fake_reward_models(1) as [server]:
            client = RewardModelClient([server.address], timeout_s=5)
            try:
                said = await asyncio.gather(*(client.generate(t, 4, 0.0) for t in TEXTS))
                mixed = await asyncio.gather(
                    client.generate("a ok", 4, 0.0), client.generate("b", 2, 0.0), client.classify("abc")
                )
                scores = await asyncio.gather(*(client.classify(t) for t in TEXTS))
            finally:
                await client.close()
            return said, mixed, scores, server.bodies, client

    said, mixed, scores, bodies, client = run(drive())
    assert said == ["Y", "N", "Y", "N"] and mixed == ["Y", "N", 3.0] and scores == [7.0, 5.0, 7.0, 5.0]
    params = {"max_new_tokens": 4, "temperature": 0.0}
    assert bodies[0] == ("/generate", {"text": TEXTS, "sampling_params": params})
    assert sorted(bodies[1:4], key=str) == sorted(
        [
            ("/generate", {"text": ["a ok"], "sampling_params": params}),
            ("/generate", {"text": ["b"], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}),
            ("/classify", {"text": ["abc"]}),
        ],
        key=str,
    )
    assert bodies[4] == ("/classify", {"text": TEXTS})
    assert (client.requests, client.prompts) == (5, 11)


def test_batches_go_round_robin_and_past_a_dead_server():
    async def drive():
        async with fake_reward_models(2) as servers:
            client = RewardModelClient([s.address for s in servers], timeout_s=5)
            try:
                for _ in range(4):
                    await asyncio.gather(client.classify("x"), client.classify("y"))
                counts = [len(s.bodies) for s in servers]
                dead = RewardModelClient([closed_port_address(), servers[0].address], timeout_s=5)
                try:
                    answered = await dead.classify("abcd")
                finally:
                    await dead.close()
            finally:
                await client.close()
            return counts, answered

    counts, answered = run(drive())
    assert counts == [2, 2] and answered == 4.0


def test_a_refusal_and_a_dead_server_raise_naming_the_server_and_what_it_said():
    async def drive():
        async with fake_reward_models(1) as [server]:
            server.status = 400
            client = RewardModelClient([server.address], timeout_s=5)
            try:
                with pytest.raises(InferenceError) as refused:
                    await client.generate("x", 4, 0.0)
            finally:
                await client.close()
            return server.address, refused.value

    address, refused = run(drive())
    assert refused.server == address and refused.status == 400
    assert f"POST /generate on {address} failed with HTTP 400" in str(refused)
    assert "fake refusal of /generate" in str(refused)
    dead = closed_port_address()

    async def dead_server():
        client = RewardModelClient([dead], timeout_s=5, backoff_s=0.01)
        try:
            await client.classify("x")
        finally:
            await client.close()

    with pytest.raises(InferenceError, match=f"POST /classify failed after 2 attempt.*{dead}.*Connect") as error:
        run(dead_server())
    assert error.value.server == dead


def test_a_batch_past_its_deadline_fails_naming_the_server_and_the_wait_is_counted():
    async def drive():
        async with fake_reward_models(1) as [server]:
            server.hang = True
            client = RewardModelClient([server.address], timeout_s=0.5)
            start = time.monotonic()
            try:
                results = await asyncio.gather(
                    client.generate("a", 4, 0.0), client.generate("b", 4, 0.0), return_exceptions=True
                )
            finally:
                await client.close()
            return server.address, results, time.monotonic() - start, client.wait_s, len(server.bodies)

    address, results, took, waited, requests = run(drive())
    assert requests == 1 and all(isinstance(r, InferenceError) for r in results)
    assert f"POST /generate on reward-model server {address}: no answer to a batch of 2 within" in str(results[0])
    assert "reward.timeout_s=0.5 s" in str(results[0])
    assert 0.5 <= took < 2.0 and 0.45 <= waited <= took


def test_the_bodies_sent_are_what_sglangs_request_classes_take():
    """The bodies the client sends, checked as SGLang 0.5.23's app checks them: ``/generate`` against
    ``GenerateReqInput`` and its JSON contract gate, ``/classify`` against ``EmbeddingReqInput`` (``check`` of the
    inference contract test: the class validates it, and it holds no field SGLang would ignore)."""
    from pydantic import TypeAdapter

    from tests.inference.test_sglang_contract import check

    async def drive():
        async with fake_reward_models(1) as [server]:
            client = RewardModelClient([server.address], timeout_s=5)
            try:
                await asyncio.gather(client.generate("8+6=4?", 3, 0.0), client.generate("8+6=5?", 3, 0.0))
                await client.generate("one", 1, 0.7)
                await asyncio.gather(client.classify("2+3=5"), client.classify("2+3=6"))
            finally:
                await client.close()
            return server.bodies

    bodies = run(drive())
    wheel = Wheel(fetch_wheel())
    routes = wheel.routes()
    io_struct = wheel.io_struct(["GenerateReqInput", "EmbeddingReqInput"])
    api = wheel.module("api/v1/api_types.py")
    assert routes["/classify"]["body"] == "EmbeddingReqInput" and routes["/generate"]["body"] == "GenerateReqInput"
    assert [path for path, _ in bodies] == ["/generate", "/generate", "/classify"]
    for path, body in bodies:
        assert check(routes[path], body, io_struct, api, TypeAdapter) == "", (path, body)
    # the check can fail: a field SGLang does not have, and a sampling setting misspelt
    assert "would ignore it silently" in check(
        routes["/classify"], {"text": ["a"], "x": 1}, io_struct, api, TypeAdapter
    )
    wrong = {"text": ["a"], "sampling_params": {"max_new_token": 3}}
    assert "contract gate refuses it" in check(routes["/generate"], wrong, io_struct, api, TypeAdapter)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="no reward-model server addresses"):
        RewardModelClient([], timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s must be seconds > 0"):
        RewardModelClient(["a:1"], timeout_s=0)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        run(RewardModelClient(["a:1"], timeout_s=1).generate("x", 0, 0.0))
