"""One real server per test on loopback: every refusal is typed, and refused requests never reach a handler."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import threading
import time

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
from hpcrl.rpc.messages import Ack, Echo, ErrorReply, Ping, Pong
from tests.rpc.conftest import TOKEN, Counting, assert_same, bearer, raw_post, sample


def call(address: str, method: str, msg, token: str = TOKEN, **kw):
    async def go():
        async with RpcClient([address], token, **kw) as client:
            return (await client.call(method, [msg]))[0]

    return asyncio.run(go())


def error_reply(status_body: tuple[int, bytes], status: int) -> ErrorReply:
    got, body = status_body
    assert got == status, body[:300]
    return decode(body, ErrorReply)


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


@pytest.mark.parametrize("headers", [{}, bearer("wrong"), {"Authorization": TOKEN}, bearer(TOKEN + "x")])
def test_request_without_the_token_is_refused_and_never_handled(serve, headers):
    handler = Counting()
    _, address = serve({"echo": handler})
    reply = error_reply(raw_post(address, "echo", encode(Ping()), headers), 401)
    assert reply.error_type == "AuthError" and "token" in reply.message
    with pytest.raises(AuthError, match="401"):
        call(address, "echo", Ping(), token="wrong")
    assert handler.calls == []


def test_wrong_token_with_a_large_body_is_refused_before_the_body_is_sent(serve):
    """RpcClient sends ``Expect: 100-continue``: the refusal comes on the headers alone."""
    handler = Counting()
    _, address = serve({"echo": handler})
    big = Echo([torch.zeros(64 << 20, dtype=torch.uint8)], "")
    start = time.monotonic()
    with pytest.raises(AuthError):
        call(address, "echo", big, token="wrong")
    assert handler.calls == []
    assert call(address, "echo", Ping()) == Ping(), "the server still serves the right token"
    print(f"refusal of a 64 MiB request took {time.monotonic() - start:.3f} s")


def test_token_is_checked_before_the_method_and_the_size(serve):
    _, address = serve({"echo": Counting()}, max_body_bytes=10)
    assert error_reply(raw_post(address, "nope", b"x" * 100, bearer("bad")), 401).error_type == "AuthError"


@pytest.mark.parametrize(
    ("verb", "path"),
    [("POST", "/rpc/echo"), ("POST", "/rpc/nope"), ("POST", "/rpc/a/b"), ("POST", "/rpc/"), ("GET", "/rpc/echo"),
     ("PUT", "/rpc/shutdown"), ("POST", "/"), ("DELETE", "/x"), ("GET", "/rpc/%2e%2e/etc")],
)  # fmt: skip
@pytest.mark.parametrize("expect", [{}, {"Expect": "100-continue"}], ids=["plain", "expect"])
def test_without_the_token_every_path_and_method_gets_the_same_401(serve, verb, path, expect):
    """Authentication before routing: a 404 or 405 (or a "100 Continue" on some paths only) would tell a
    stranger which paths and methods exist."""
    handler = Counting()
    _, address = serve({"echo": handler})
    host, port = parse_hostport(address)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request(verb, path, body=b"x", headers={"Content-Length": "1", **bearer("wrong"), **expect})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    assert response.status == 401, body
    reply = decode(body, ErrorReply)
    assert (reply.method, reply.error_type) == ("", "AuthError") and "token" in reply.message
    assert body == encode(ErrorReply(0, "", "AuthError", reply.message, "")), "one reply for every path and method"
    assert handler.calls == []


def test_garbage_body_is_a_400_with_the_decode_error(serve):
    handler = Counting()
    _, address = serve({"echo": handler})
    reply = error_reply(raw_post(address, "echo", b"\x00garbage" * 10, bearer()), 400)
    assert (reply.error_type, reply.method) == ("DecodeError", "echo")
    assert "not an hpcrl RPC frame" in reply.message
    truncated = error_reply(raw_post(address, "echo", encode(Echo([torch.ones(10)], ""))[:-5], bearer()), 400)
    assert "frame truncated" in truncated.message
    assert handler.calls == []


def test_body_cut_short_by_the_client_never_reaches_the_handler(serve):
    handler = Counting()
    _, address = serve({"echo": handler})
    frame = encode(Echo([torch.ones(1000)], ""))
    with socket.create_connection(parse_hostport(address)) as sock:
        head = f"POST /rpc/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        sock.sendall(f"{head}Content-Length: {len(frame)}\r\n\r\n".encode() + frame[:100])
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
    assert error_reply(raw_post(address, "echo", bytes(5000), bearer()), 413).error_type == "PayloadTooLarge"
    assert call(address, "echo", Ping()) == Ping()
    assert handler.calls == [Ping()]


def test_unknown_method_names_the_known_ones(serve):
    _, address = serve({"train_step": Counting(), "ping": Counting()})
    with pytest.raises(UnknownMethodError, match=r"no RPC method 'trian_step'.*\['ping', 'shutdown', 'train_step'\]"):
        call(address, "trian_step", Ping())


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
