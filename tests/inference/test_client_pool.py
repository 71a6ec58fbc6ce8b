"""The client's pool changing under it: a dead server taken out, a restarted one put back."""

import asyncio
import logging

import pytest

from hpcrl.inference.client import InferenceClient, InferenceError
from tests.inference.test_client_fakes import fake_servers, run, wait_for_requests

PARAMS = {"max_new_tokens": 3, "temperature": 1.0}


def test_a_removed_server_is_never_picked_and_gets_no_control_call():
    client = InferenceClient(["h:1", "h:2", "h:3"])
    client.remove("h:2")
    assert {client.pick() for _ in range(10)} == {"h:1", "h:3"}
    assert set(client._same({})) == {"h:1", "h:3"}  # pause, resume, weight updates go to these only


def test_the_last_server_and_unknown_ones_cannot_be_removed():
    client = InferenceClient(["h:1", "h:2"])
    with pytest.raises(ValueError, match="not in the pool"):
        client.remove("h:9")
    client.remove("h:1")
    with pytest.raises(ValueError, match="the last one"):
        client.remove("h:2")


def test_requests_wait_while_the_pool_is_empty_and_go_to_the_server_that_joins():
    async def body():
        async with fake_servers(2) as [old, new], InferenceClient([old.address], backoff_s=0.01) as client:
            client.remove(old.address, last_ok=True)  # its only server died and is restarting
            waiting = asyncio.create_task(client.generate([1], PARAMS))
            await asyncio.sleep(0.3)
            assert not waiting.done(), "a request must wait for a server, not fail"
            await client.pause()  # control calls go to nobody meanwhile
            client.add(new.address)
            result = await asyncio.wait_for(waiting, 5)
            assert result.server == new.address
            assert old.bodies("/generate") == [] and len(new.bodies("/generate")) == 1

    run(body())


def test_the_wait_for_a_server_has_a_deadline():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address], no_server_timeout_s=0.2) as client:
            client.remove(fake.address, last_ok=True)
            with pytest.raises(InferenceError, match=r"the pool held 0 inference servers, fewer than 1, for 0\.2 s"):
                await client.generate([1], PARAMS)

    run(body())


def test_below_min_servers_new_requests_wait_for_a_server_to_join_an_elastic_fleet(caplog):
    async def body():
        async with fake_servers(3) as [a, b, joiner], InferenceClient([a.address, b.address], min_servers=2) as client:
            assert (await client.generate([1], PARAMS)).server in (a.address, b.address)
            client.remove(b.address)  # one of two died: one is live, fewer than 2
            waiting = [asyncio.create_task(client.generate([1], PARAMS)) for _ in range(3)]
            await asyncio.sleep(0.3)
            assert not any(w.done() for w in waiting), "below min_servers requests wait, not go to the live server"
            client.add(joiner.address)
            results = await asyncio.wait_for(asyncio.gather(*waiting), 5)
            assert {r.server for r in results} <= {a.address, joiner.address}
            assert len(a.bodies("/generate")) + len(joiner.bodies("/generate")) == 4

    with caplog.at_level(logging.INFO, logger="hpcrl.inference.client"):
        run(body())
    said = [r.getMessage() for r in caplog.records if "servers in the pool; waiting" in r.getMessage()]
    assert said == ["1 of at least 2 servers in the pool; waiting up to 600 s for more"], "once, not per request"


def test_the_client_counts_each_servers_answers_and_logs_its_first_with_the_weight_version(caplog):
    async def body():
        async with fake_servers(2) as [a, b], InferenceClient([a.address]) as client:
            await client.generate([1], PARAMS)
            client.add(b.address)
            await client.generate_many([[1], [2]], PARAMS, server=b.address)
            await client.generate([1], PARAMS, server=b.address)
            client.remove(b.address)  # it left, and comes back at the same address (a requeued server)
            client.add(b.address)
            await client.generate([1], PARAMS, server=b.address)
            return client.answered

    with caplog.at_level(logging.INFO, logger="hpcrl.inference.client"):
        answered = run(body())
    assert sorted(answered.values()) == [1, 4]
    firsts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("first answer from server")]
    assert len(firsts) == 3 and all("weight version" in line for line in firsts), firsts


def test_a_request_in_flight_on_a_server_that_leaves_goes_on_another_at_once_and_a_weight_update_fails():
    async def body():
        async with fake_servers(2) as [silent, live], InferenceClient([silent.address, live.address]) as client:
            silent.hang = True  # its node went silent: no answer, no reset
            request = asyncio.create_task(client.generate([1], PARAMS, rid="r1"))
            await wait_for_requests([silent], "/generate", 1)
            silent.delay_s = 3600  # a weight update would hang there too
            update = asyncio.create_task(client.update_weights_from_disk("/w/v2", 2))
            await wait_for_requests([silent], "/update_weights_from_disk", 1)
            client.remove(silent.address)
            result = await asyncio.wait_for(request, 2)  # not the 120 s request deadline
            assert result.server == live.address and live.bodies("/generate")[0]["rid"] == "r1"
            with pytest.raises(InferenceError, match="left the pool"):
                await asyncio.wait_for(update, 2)

    run(body())


def test_weights_can_go_to_one_server_only():
    async def body():
        async with fake_servers(2) as [a, b], InferenceClient([a.address]) as client:
            await client.update_weights_from_disk("/w/v3", 3, servers=[b.address])
            assert a.bodies("/update_weights_from_disk") == []
            assert b.bodies("/update_weights_from_disk")[0]["model_path"] == "/w/v3"

    run(body())


def test_set_servers_makes_the_pool_exactly_those():
    client = InferenceClient(["h:1", "h:2"])
    client.set_servers(["h:3", "h:2"])
    assert client.addresses == ["h:3", "h:2"]
    client.set_servers([])
    assert client.addresses == []
    with pytest.raises(ValueError, match="already in the pool"):
        client.set_servers(["h:4"]) or client.add("h:4")


def test_set_servers_with_a_bad_address_changes_nothing():
    client = InferenceClient(["h:1"])
    for bad in (["h:2", "no-port"], ["h:2", "h:2"]):
        with pytest.raises(ValueError):
            client.set_servers(bad)
        assert client.addresses == ["h:1"]


def test_a_request_waits_for_a_restarting_server_as_long_as_its_setup_and_queue_allow():
    from hpcrl.config.schema import ClusterConfig

    local = ClusterConfig()
    setup_s = local.roles["server"].setup_timeout_s
    assert local.server_wait_s() == setup_s
    assert ClusterConfig(kind="slurm", queue_timeout_min=10).server_wait_s() == setup_s + 600
    no_queue_limit = ClusterConfig(kind="slurm", time_min=30)
    assert no_queue_limit.server_wait_s() == setup_s + 1800, "no queue limit: the worker jobs' time limit"
