"""One real server per test on loopback: every refusal is typed, and refused requests never reach a handler."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import time
import tracemalloc
import weakref

import pytest
import torch

from hpcrl.net import has_ipv6, parse_hostport
from hpcrl.rpc import (
    MESSAGES,
    AuthError,
    BadRequestError,
    PayloadTooLargeError,
    RemoteError,
    RpcClient,
    RpcServer,
    UnknownMethodError,
    decode,
    encode,
)
from hpcrl.rpc.messages import Ack, Echo, ErrorReply, Ping, Pong, Welcome
from hpcrl.rpc.server import MAX_PENDING_HELLOS
from hpcrl.rpc.transport import HELLO
from tests.rpc.conftest import TOKEN, Counting, RawConnection, assert_same, sample


def call(address: str, method: str, msg, token: str = TOKEN, **kw):
    async def go():
        async with RpcClient([address], token, **kw) as client:
            return (await client.call(method, [msg]))[0]

    return asyncio.run(go())


def test_every_message_type_round_trips_through_a_server(serve):
    _, address = serve({"echo": Counting()})

    async def go():
        async with RpcClient([address], TOKEN) as client:
            for name, cls in sorted(MESSAGES.items()):
                msg = sample(cls, seed=len(name))
                assert_same((await client.call("echo", [msg]))[0], msg)

    asyncio.run(go())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float32])
def test_tensors_cross_the_wire_bit_exactly(serve, dtype):
    _, address = serve({"echo": Counting()})
    t = (torch.randn(33, 17) * 1e4).to(dtype)
    reply = call(address, "echo", Echo([t, t[::2, 1:]], "x"))
    assert [r.dtype for r in reply.tensors] == [dtype, dtype]
    assert_same(reply, Echo([t, t[::2, 1:]], "x"))


def test_ping(serve):
    _, address = serve({"ping": lambda _: Pong(rank=3, pid=os.getpid())}, rank=3)
    assert call(address, "ping", Ping()) == Pong(3, os.getpid())


def refusal(status_body: tuple[int, bytes], status: int) -> ErrorReply:
    got, body = status_body
    assert got == status, body[:300]
    return decode(body, ErrorReply)


@pytest.mark.parametrize("token", ["", "wrong", TOKEN + "x", TOKEN[:-1], "x" * 2000], ids=len)
def test_a_connection_without_the_token_is_refused_and_closed(serve, token):
    handler = Counting()
    _, address = serve({"echo": handler})
    with RawConnection(address) as raw:
        reply = refusal(raw.hello(token), 401)
        assert (reply.method, reply.error_type) == ("", "AuthError") and "token" in reply.message
        assert raw.closed_by_server()
    with pytest.raises(AuthError, match="status 401"):
        call(address, "echo", Ping(), token="wrong")
    assert handler.calls == []


def test_the_refusal_of_a_token_tells_nothing_of_what_follows(serve):
    """The token before anything else: a request after a wrong hello, for a method that exists or not, of any
    size, gets the same one 401 and nothing else (a 404 would tell a stranger which methods exist)."""
    handler = Counting()
    _, address = serve({"echo": handler}, max_body_bytes=10)
    answers = set()
    for method, body in [("echo", encode(Ping())), ("nope", b"x" * 100), ("shutdown", encode(Ack()))]:
        with RawConnection(address) as raw:
            raw.sock.sendall(HELLO.pack(b"HRPT", 1, 5) + b"wrong")
            raw.request(method, body)
            answers.add(raw.reply())
            assert raw.closed_by_server()
    assert len(answers) == 1, answers
    assert refusal(answers.pop(), 401).error_type == "AuthError"
    assert handler.calls == []


def test_the_token_is_sent_once_per_connection_and_not_again(serve):
    _, address = serve({"echo": Counting()})
    with RawConnection(address) as raw:
        status, body = raw.hello()
        assert status == 200
        assert decode(body, Welcome) == Welcome(0, ["echo", "shutdown"], 8 << 30)
        for i in range(3):
            raw.request("echo", encode(Pong(i, 0)))
            assert decode(raw.reply()[1]) == Pong(i, 0)


def test_wrong_token_with_a_large_body_is_refused_before_the_body_is_sent(serve):
    """The token is checked on the connection's hello: the body of a refused client is never sent."""
    handler = Counting()
    _, address = serve({"echo": handler})
    big = Echo([torch.zeros(64 << 20, dtype=torch.uint8)], "")
    start = time.monotonic()
    with pytest.raises(AuthError):
        call(address, "echo", big, token="wrong")
    assert handler.calls == []
    assert call(address, "echo", Ping()) == Ping(), "the server still serves the right token"
    print(f"refusal of a 64 MiB request took {time.monotonic() - start:.3f} s")


HTTP = [("POST", "/rpc/echo"), ("POST", "/rpc/nope"), ("GET", "/rpc/echo"), ("PUT", "/rpc/shutdown"), ("DELETE", "/x")]


@pytest.mark.parametrize(("verb", "path"), HTTP)
def test_an_http_request_gets_one_line_saying_what_the_port_speaks(serve, verb, path):
    handler = Counting()
    _, address = serve({"echo": handler})
    with RawConnection(address) as raw:
        head = f"{verb} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 1\r\n\r\nx"
        raw.sock.sendall(head.encode())
        text = b"".join(iter(lambda: raw.sock.recv(4096), b""))
    assert text == b"this port speaks hpcrl's RPC (hpcrl.rpc.RpcClient), not HTTP or anything else\n"
    assert handler.calls == []


def test_a_connection_that_sends_no_hello_is_closed_after_the_hello_timeout(serve):
    _, address = serve({"echo": Counting()}, hello_timeout_s=0.5)
    for start in (b"", b"HRPT\x00"):  # nothing, then half a hello
        with RawConnection(address, timeout_s=10) as raw:
            raw.sock.sendall(start)
            began = time.monotonic()
            assert raw.closed_by_server()
            assert time.monotonic() - began < 5
    assert call(address, "echo", Ping()) == Ping()


def idle_connections(address: str, n: int) -> list[socket.socket]:
    """``n`` connections that never say hello (a port scanner's, say)."""
    return [socket.create_connection(parse_hostport(address), timeout=10) for _ in range(n)]


def test_connections_without_a_hello_are_capped_and_hold_little_memory(serve):
    server, address = serve({"echo": Counting()})  # the default cap; the hello timeout (30 s) does not come
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idle = idle_connections(address, 300)
        deadline = time.monotonic() + 10
        while server.connections_accepted < MAX_PENDING_HELLOS and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # time to accept more, if it would
        accepted = server.connections_accepted
        grown = tracemalloc.get_traced_memory()[1] - before  # the peak
    finally:
        tracemalloc.stop()
    # the rest wait in the kernel's listen backlog (the oldest make room only after CROWDED_HELLO_S)
    assert accepted == MAX_PENDING_HELLOS, f"{accepted} connections without a hello accepted"
    assert grown < 1 << 20, f"{grown} bytes for {accepted} idle connections"  # buffers of 1 KiB, not 64 KiB
    assert server.pending_hellos == MAX_PENDING_HELLOS
    for sock in idle:
        sock.close()
    assert call(address, "echo", Ping()) == Ping()


def test_a_client_gets_in_while_idle_connections_fill_the_cap_and_the_oldest_make_room(serve):
    server, address = serve({"echo": Counting()}, max_pending_hellos=4, crowded_hello_s=0.3, hello_timeout_s=60)
    idle = [RawConnection(address, timeout_s=10) for _ in range(3 * 4)]  # the cap, and twice as many queued
    assert call(address, "echo", Ping(), connect_timeout_s=10) == Ping()  # not locked out for the hello timeout
    # accepted after all 12, with at most 3 of them still waiting: the 9 oldest were closed to make room, long
    # before the hello timeout (else recv's 10 s timeout raises)
    assert all(raw.closed_by_server() for raw in idle[:9])
    assert server.connections_accepted == 13 and server.pending_hellos <= 3
    for raw in idle:
        raw.sock.close()


def test_a_burst_of_clients_larger_than_the_cap_is_slowed_not_refused(serve):
    async def slow(msg):
        await asyncio.sleep(0.2)  # every call holds its connection: 40 connections are opened at once
        return msg

    server, address = serve({"slow": slow}, max_pending_hellos=2)

    async def go():
        async with RpcClient([address], TOKEN, max_connections=40) as client:
            return await asyncio.gather(*(client.call("slow", [Echo([], str(i))]) for i in range(40)))

    assert [reply.note for (reply,) in asyncio.run(go())] == [str(i) for i in range(40)]
    assert server.connections_accepted == 40


def test_another_transport_version_is_refused(serve):
    _, address = serve({"echo": Counting()})
    with RawConnection(address) as raw:
        raw.sock.sendall(HELLO.pack(b"HRPT", 2, len(TOKEN)) + TOKEN.encode())
        reply = refusal(raw.reply(), 400)
        assert reply.error_type == "VersionError" and "this server speaks 1" in reply.message
        assert raw.closed_by_server()


def test_garbage_body_is_a_400_with_the_decode_error_and_the_connection_goes_on(serve):
    handler = Counting()
    _, address = serve({"echo": handler})
    with RawConnection(address) as raw:
        assert raw.hello()[0] == 200
        raw.request("echo", b"\x00garbage" * 10)
        reply = refusal(raw.reply(), 400)
        assert (reply.error_type, reply.method) == ("DecodeError", "echo")
        assert "not an hpcrl RPC frame" in reply.message
        raw.request("echo", encode(Echo([torch.ones(10)], ""))[:-5])
        assert "frame truncated" in refusal(raw.reply(), 400).message
        assert handler.calls == []
        raw.request("echo", encode(Ping()))
        assert raw.reply() == (200, encode(Ping())), "the framing held: the same connection serves the next request"
    assert handler.calls == [Ping()]


def test_a_request_header_that_is_not_one_is_a_400_and_the_connection_closes(serve):
    handler = Counting()
    _, address = serve({"echo": handler})
    with RawConnection(address) as raw:
        assert raw.hello()[0] == 200
        raw.sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert refusal(raw.reply(), 400).error_type == "BadRequest"
        assert raw.closed_by_server()
    assert handler.calls == []


def test_body_cut_short_by_the_client_never_reaches_the_handler(serve):
    handler = Counting()
    _, address = serve({"echo": handler})
    frame = encode(Echo([torch.ones(1000)], ""))
    with RawConnection(address) as raw:
        assert raw.hello()[0] == 200
        raw.request("echo", frame[:100], declared=len(frame))
    assert call(address, "echo", Ping()) == Ping()
    assert handler.calls == [Ping()]


def test_wrong_message_type_for_an_annotated_handler_is_a_400(serve):
    def ping(msg: Ping) -> Pong:
        return Pong(0, 0)

    _, address = serve({"ping": ping})
    with pytest.raises(BadRequestError, match="expected a Ping message, got Echo"):
        call(address, "ping", Echo([], ""))


def test_oversized_body_is_refused_before_reading(serve):
    handler = Counting()
    _, address = serve({"echo": handler}, max_body_bytes=4096)
    with pytest.raises(PayloadTooLargeError, match="over this server's limit of 4096"):
        call(address, "echo", Echo([torch.zeros(10_000)], ""))
    with RawConnection(address) as raw:  # a client that does not check the Welcome: refused on the header
        assert raw.hello()[0] == 200
        raw.request("echo", b"", declared=1 << 40)  # no body follows: the refusal cannot wait for one
        assert refusal(raw.reply(), 413).error_type == "PayloadTooLarge"
        assert raw.closed_by_server()
    assert call(address, "echo", Ping()) == Ping()
    assert handler.calls == [Ping()]


def test_unknown_method_names_the_known_ones(serve):
    handler = Counting()
    _, address = serve({"train_step": handler, "ping": Counting()})
    with pytest.raises(UnknownMethodError, match=r"no RPC method 'trian_step'.*\['ping', 'shutdown', 'train_step'\]"):
        call(address, "trian_step", Ping())
    with RawConnection(address) as raw:
        assert raw.hello()[0] == 200
        raw.request("trian_step", b"", declared=1000)  # refused on the header: the body is never read
        reply = refusal(raw.reply(), 404)
        assert reply.message == "no RPC method 'trian_step'; this server has ['ping', 'shutdown', 'train_step']"
        assert raw.closed_by_server()
    assert handler.calls == []


def raising_handler(msg):
    raise ValueError(f"cannot handle {type(msg).__name__}")


def test_handler_exception_is_a_remote_error_with_the_traceback(serve):
    _, address = serve({"bad": raising_handler}, rank=0)
    with pytest.raises(RemoteError) as info:
        call(address, "bad", Ping())
    error = info.value
    assert (error.rank, error.address, error.method, error.error_type) == (0, address, "bad", "ValueError")
    assert error.message == "cannot handle Ping"
    assert "raising_handler" in error.traceback
    assert "rank 0" in str(error) and address in str(error) and "raising_handler" in str(error)


def test_remote_error_mentions_a_rank_that_does_not_match_the_address_list(serve):
    _, address = serve({"bad": raising_handler}, rank=5)
    with pytest.raises(RemoteError, match="cannot handle Ping \\(the server there says it is rank 5\\)"):
        call(address, "bad", Ping())


def test_a_reply_that_is_not_a_message_is_a_remote_error(serve):
    _, address = serve({"bad": lambda _: {"not": "a message"}})
    with pytest.raises(RemoteError, match="EncodeError: dict is not a registered message"):
        call(address, "bad", Ping())


def test_handlers_run_one_at_a_time_in_arrival_order_on_one_thread(serve):
    order, active, overlap = [], [0], []

    def handler(msg: Pong) -> Ack:
        active[0] += 1
        overlap.append(active[0])
        time.sleep(0.01)
        order.append(msg.rank)
        active[0] -= 1
        return Ack()

    counting = Counting()
    _, address = serve({"work": handler, "count": counting}, thread_init=lambda: threading.current_thread().name)

    async def go():
        async with RpcClient([address], TOKEN) as client:
            for i in range(20):
                await client.call("work", [Pong(i, 0)])
            await asyncio.gather(*(client.call("work", [Pong(100 + i, 0)]) for i in range(10)))
            await client.call("count", [Ack()])

    asyncio.run(go())
    assert order[:20] == list(range(20)) and sorted(order[20:]) == list(range(100, 110))
    assert max(overlap) == 1
    assert counting.threads == {"rpc-handler-0"}


def test_thread_init_failure_is_reported_by_every_call(serve):
    def init():
        raise RuntimeError("no such device")

    _, address = serve({"ping": Counting()}, thread_init=init)
    with pytest.raises(RemoteError, match=r"init failed.*no such device"):
        call(address, "ping", Ping())


def test_shutdown_replies_then_stops(serve):
    hook = Counting(reply=Ack())
    server, address = serve({"ping": Counting(), "shutdown": hook})

    async def go():
        async with RpcClient([address], TOKEN) as client:
            await client.shutdown()

    asyncio.run(go())
    server.serve_until_stopped(timeout_s=15)
    assert hook.calls == [Ack()]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(parse_hostport(address), timeout=5)


def test_run_on_the_calling_thread(serve):
    server = RpcServer({"ping": Counting()}, TOKEN, rank=0)
    addresses = []

    def on_ready(address):
        addresses.append(address)
        threading.Thread(target=lambda: (call(address, "ping", Ping()), server.stop())).start()

    server.run(on_ready)
    assert len(addresses) == 1


def test_port_in_use_is_raised_by_start_in_thread(serve):
    _, address = serve({})
    with pytest.raises(OSError):
        RpcServer({}, TOKEN, 1, port=parse_hostport(address)[1]).start_in_thread(timeout_s=10)


@pytest.mark.skipif(not has_ipv6(), reason="IPv6 loopback is not available on this machine")
def test_ipv6_loopback(serve):
    _, address = serve({"echo": Counting()}, host="::1")
    assert address.startswith("[::1]:")
    t = torch.arange(10).bfloat16()
    assert_same(call(address, "echo", Echo([t], "v6")), Echo([t], "v6"))


def test_calls_one_after_another_share_one_connection(serve):
    server, address = serve({"echo": Counting()})

    async def go():
        async with RpcClient([address], TOKEN) as client:
            for i in range(20):
                assert await client.call("echo", [Pong(i, 0)]) == [Pong(i, 0)]
            assert server.connections_accepted == 1
            await asyncio.gather(*(client.call("echo", [Pong(i, 0)]) for i in range(4)))
            opened = server.connections_accepted
            assert 2 <= opened <= 4, "calls at once each need a connection of their own"
            for i in range(10):
                await client.call("echo", [Pong(i, 0)])
            assert server.connections_accepted == opened, "idle connections are reused"

    asyncio.run(go())


def test_a_server_restarted_on_the_same_port_is_reached_on_a_new_connection(serve):
    """The idle connection to the old server has ended: the client must not send the next call on it."""
    first, address = serve({"echo": Counting()})
    port = parse_hostport(address)[1]

    async def go():
        async with RpcClient([address], TOKEN) as client:
            assert await client.call("echo", [Pong(1, 0)]) == [Pong(1, 0)]
            first.stop()
            await asyncio.to_thread(first.serve_until_stopped, 30)
            second, _ = await asyncio.to_thread(serve, {"echo": Counting(reply=Pong(2, 2))}, port=port)
            await asyncio.sleep(0.1)  # the end of the old connection reaches the client's loop
            assert await client.call("echo", [Pong(1, 0)]) == [Pong(2, 2)]
            assert second.connections_accepted == 1

    asyncio.run(go())


def test_stop_lets_a_request_in_flight_finish(serve):
    started = threading.Event()

    def slow(msg):
        started.set()
        time.sleep(0.5)
        return msg

    server, address = serve({"slow": slow}, shutdown_timeout_s=10)
    replies = []
    caller = threading.Thread(target=lambda: replies.append(call(address, "slow", Pong(5, 5))))
    caller.start()
    assert started.wait(10)
    server.stop()
    caller.join(30)
    assert replies == [Pong(5, 5)]
    server.serve_until_stopped(timeout_s=10)


def test_a_reply_larger_than_the_socket_takes_at_once_arrives_whole(serve):
    """The handler thread sends what the socket takes; the event loop sends the rest."""
    _, address = serve({"echo": Counting()})
    t = torch.randint(0, 256, (48 << 20,), dtype=torch.uint8)
    reply = call(address, "echo", Echo([t], "big"))
    assert reply.note == "big" and torch.equal(reply.tensors[0], t)


def test_a_coroutine_handler_that_raises_is_a_remote_error(serve):
    async def bad(msg):
        raise KeyError("no such episode")

    _, address = serve({"bad": bad})
    with pytest.raises(RemoteError, match="KeyError") as info:
        call(address, "bad", Ping())
    assert "in bad" in info.value.traceback


def _slow_echo(msg):
    time.sleep(0.3)  # long enough for the next request to arrive while this handler still runs
    return msg


def test_a_refusal_pipelined_behind_a_slow_handler_is_sent_after_its_reply(serve):
    """The event loop reads the next header while the handler thread still answers the previous request: it
    must not refuse (and close) before that reply has left, nor reorder the replies."""
    _, address = serve({"slow": _slow_echo})
    with RawConnection(address) as conn:
        assert conn.hello()[0] == 200
        conn.request("slow", encode(Pong(7, 8)))
        conn.request("nope", b"")
        status, body = conn.reply()
        assert (status, decode(body)) == (200, Pong(7, 8))
        status, body = conn.reply()
        assert status == 404 and decode(body, ErrorReply).error_type == "UnknownMethod"
        assert conn.closed_by_server()


def test_pipelined_requests_on_one_connection_are_answered_in_order(serve):
    _, address = serve({"slow": _slow_echo, "echo": Counting()})
    with RawConnection(address) as conn:
        assert conn.hello()[0] == 200
        for i in range(3):
            conn.request("slow" if i == 0 else "echo", encode(Pong(i, i)))
        assert [decode(conn.reply()[1]) for _ in range(3)] == [Pong(0, 0), Pong(1, 1), Pong(2, 2)]


def test_a_client_that_half_closes_after_its_request_still_gets_the_reply(serve):
    """The end of the client's stream between requests must not close the connection before the reply of a
    request still in the handler has left."""
    _, address = serve({"slow": _slow_echo})
    with RawConnection(address) as conn:
        assert conn.hello()[0] == 200
        conn.request("slow", encode(Pong(1, 2)))
        conn.sock.shutdown(socket.SHUT_WR)
        status, body = conn.reply()
        assert (status, decode(body)) == (200, Pong(1, 2))
        assert conn.closed_by_server()


def test_a_request_is_freed_once_its_handler_has_run_not_at_the_next_request(serve):
    """The message (and the receive buffer its tensors share) must not stay alive while the connection is idle."""
    seen: list[weakref.ref] = []

    def keep_a_weakref(msg: Echo) -> Ack:
        seen.append(weakref.ref(msg.tensors[0]))
        return Ack()

    _, address = serve({"sink": keep_a_weakref})
    with RawConnection(address) as conn:
        assert conn.hello()[0] == 200
        conn.request("sink", encode(Echo([torch.ones(1 << 20, dtype=torch.uint8)], "")))
        assert conn.reply()[0] == 200
        deadline = time.monotonic() + 5
        while seen[0]() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert seen[0]() is None, "the request's tensor is still alive after its reply, with no other request"
