"""Fan-out from one client to several real servers: shards in rank order, failures never left dangling."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch

from hpcrl.net import format_hostport
from hpcrl.rpc import RemoteError, RpcClient, RpcConnectionError, RpcError, RpcTimeoutError
from hpcrl.rpc.messages import Ack, Echo, Pong
from tests.rpc.conftest import TOKEN, Counting, assert_same


def rank_echo(rank: int):
    def handler(msg: Echo) -> Echo:
        return Echo([t + rank for t in msg.tensors], f"{msg.note} via rank {rank}")

    return handler


def fail_on(ranks: set[int], rank: int):
    def handler(msg: Pong) -> Pong:
        if rank in ranks:
            raise RuntimeError(f"rank {rank} cannot train")
        return Pong(rank, msg.pid)

    return handler


def group(serve, make_handler, n: int = 3, **kw) -> list[str]:
    return [serve({"work": make_handler(rank)}, rank=rank, **kw)[1] for rank in range(n)]


def run(addresses, method, requests, **kw):
    async def go():
        async with RpcClient(addresses, TOKEN, **kw) as client:
            return await client.call(method, requests)

    return asyncio.run(go())


def test_fan_out_sends_each_rank_its_shard_and_gathers_in_rank_order(serve):
    addresses = group(serve, rank_echo)
    shards = [Echo([torch.full((2,), 10.0 * i)], f"shard {i}") for i in range(3)]
    replies = run(addresses, "work", shards)
    for rank, reply in enumerate(replies):
        assert_same(reply, Echo([torch.full((2,), 11.0 * rank)], f"shard {rank} via rank {rank}"))


def test_broadcast_sends_the_same_request_to_every_rank(serve):
    addresses = group(serve, rank_echo)

    async def go():
        async with RpcClient(addresses, TOKEN) as client:
            return await client.broadcast("work", Echo([torch.ones(3, dtype=torch.bfloat16)], "all"))

    replies = asyncio.run(go())
    assert [r.note for r in replies] == [f"all via rank {i}" for i in range(3)]
    assert [r.tensors[0].tolist() for r in replies] == [[1.0 + i] * 3 for i in range(3)]


def test_one_rank_of_three_failing(serve):
    addresses = group(serve, lambda rank: fail_on({1}, rank))
    with pytest.raises(RemoteError) as info:
        run(addresses, "work", [Pong(0, 0)] * 3)
    assert (info.value.rank, info.value.address) == (1, addresses[1])
    assert "rank 1 cannot train" in str(info.value) and "handler" in info.value.traceback
    assert info.value.others == []


def test_two_ranks_failing_raise_the_lowest_with_the_other_attached(serve):
    addresses = group(serve, lambda rank: fail_on({1, 2}, rank))
    with pytest.raises(RemoteError) as info:
        run(addresses, "work", [Pong(0, 0)] * 3)
    assert info.value.rank == 1
    assert [e.rank for e in info.value.others] == [2]
    assert any("rank 2" in note for note in info.value.__notes__)


def test_a_hanging_rank_is_cancelled_after_the_grace_period(serve):
    release = threading.Event()

    def make(rank):
        def handler(msg: Pong) -> Pong:
            if msg.pid == 1 and rank == 0:
                raise RuntimeError("rank 0 failed first")
            if msg.pid == 1:
                release.wait(30)  # a rank stuck in a collective its failed peer will never join
            return msg

        return handler

    addresses = group(serve, make)
    start = time.monotonic()
    try:
        with pytest.raises(RemoteError) as info:
            run(addresses, "work", [Pong(0, 1)] * 3, failure_grace_s=0.5)
    finally:
        release.set()
    assert time.monotonic() - start < 10
    assert info.value.rank == 0
    assert any("ranks [1, 2]" in note and "cancelled" in note for note in info.value.__notes__)
    assert run(addresses, "work", [Pong(7, 0)] * 3) == [Pong(7, 0)] * 3, "the servers survive the cancellation"


def test_a_dead_server_is_a_connection_error_within_seconds(serve):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = format_hostport("127.0.0.1", sock.getsockname()[1])  # closed again: nothing listens there
    live = group(serve, lambda rank: Counting(), n=2)
    start = time.monotonic()
    with pytest.raises(RpcConnectionError) as info:
        run([live[0], dead, live[1]], "work", [Ack()] * 3)
    assert time.monotonic() - start < 5
    assert (info.value.rank, info.value.address) == (1, dead)
    assert "rank 1" in str(info.value) and dead in str(info.value)


def test_no_reply_within_the_timeout_is_a_connection_error(serve):
    release = threading.Event()
    _, address = serve({"work": lambda msg: release.wait(30) and msg})
    called = time.time()
    try:
        with pytest.raises(RpcTimeoutError, match=r"no reply within 0\.5 s") as info:
            run([address], "work", [Ack()], timeout_s=0.5)
    finally:
        release.set()
    assert isinstance(info.value, RpcConnectionError) and info.value.timeout_s == 0.5  # a hang report's facts
    assert called <= info.value.started <= called + 0.5


def test_wrong_number_of_requests_is_refused_before_sending(serve):
    addresses = group(serve, lambda rank: Counting(), n=2)
    with pytest.raises(ValueError, match="got 1 requests for 2 ranks"):
        run(addresses, "work", [Ack()])


def test_client_checks_addresses_and_is_used_as_a_context_manager():
    with pytest.raises(ValueError, match="host:port"):
        RpcClient(["no-port"], TOKEN)
    with pytest.raises(RuntimeError, match="async with"):
        asyncio.run(RpcClient(["127.0.0.1:1"], TOKEN).call("work", [Ack()]))


def test_max_connections_bounds_the_calls_in_flight(serve):
    running, peak = [0], [0]

    async def work(msg: Pong) -> Pong:  # on the server's loop: as many at once as the client sends
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1
        return msg

    _, address = serve({"work": work})

    async def go():
        async with RpcClient([address], TOKEN, max_connections=2) as client:
            return await asyncio.gather(*(client.call("work", [Pong(i, 0)]) for i in range(8)))

    assert asyncio.run(go()) == [[Pong(i, 0)] for i in range(8)]
    assert peak[0] == 2


def test_a_reply_over_max_reply_bytes_is_refused(serve):
    _, address = serve({"work": Counting()})
    with pytest.raises(RpcError, match="over max_reply_bytes=1000"):
        run([address], "work", [Echo([torch.zeros(2000, dtype=torch.uint8)], "")], max_reply_bytes=1000)
    assert run([address], "work", [Pong(1, 1)]) == [Pong(1, 1)]
