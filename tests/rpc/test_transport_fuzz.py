"""A live server fuzzed on its port: hundreds of connections carrying random bytes, damaged hellos and damaged
request streams. It never answers a status it should not, runs a handler only for well-formed requests with
the token, and still serves a real client afterwards."""

from __future__ import annotations

import asyncio
import random
import socket
import struct

from hpcrl.net import parse_hostport
from hpcrl.rpc import RpcClient, encode
from hpcrl.rpc.messages import Echo, Ping, Pong
from hpcrl.rpc.transport import HEAD, HELLO
from tests.rpc.conftest import TOKEN, Counting

CONNECTIONS = 400


def hello(rng: random.Random) -> tuple[bytes, bool]:
    """A hello and whether it carries the token."""
    choice = max(0, rng.randrange(-1, 5))  # the token in two of six
    if choice == 0:
        return HELLO.pack(b"HRPT", 1, len(TOKEN)) + TOKEN.encode(), True
    if choice == 1:  # the wrong token, or one claimed longer than it is
        token = rng.choice(["", "wrong", TOKEN[:-1]]).encode()
        return HELLO.pack(b"HRPT", 1, len(token) + rng.choice([0, 0, 3])) + token, False
    if choice == 2:
        return HELLO.pack(b"HRPT", rng.randrange(1 << 16), rng.randrange(1 << 16)), False
    if choice == 3:
        return rng.randbytes(rng.randrange(0, 40)), False
    return b"POST /rpc/echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", False


def request(rng: random.Random) -> bytes:
    frame = encode(rng.choice([Ping(), Pong(3, 4), Echo([], "x")]))
    method = rng.choice([b"echo", b"echo", b"nope", b"", b"e" * 200])  # not shutdown: it would end the test
    kind = max(0, rng.randrange(-2, 6))  # well formed in three of eight
    if kind == 0:
        return HEAD.pack(b"Rq", len(method), len(frame)) + method + frame
    if kind == 1:  # the frame damaged
        damaged = bytearray(frame)
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        return HEAD.pack(b"Rq", len(method), len(damaged)) + method + bytes(damaged)
    if kind == 2:  # a length that lies
        return HEAD.pack(b"Rq", len(method), rng.choice([0, 5, 1 << 40, len(frame) + 9])) + method + frame
    if kind == 3:
        return struct.pack(">2sHQ", rng.randbytes(2), rng.randrange(1 << 16), rng.randrange(1 << 64)) + frame
    if kind == 4:
        return rng.randbytes(rng.randrange(1, 300))
    return (HEAD.pack(b"Rq", len(method), len(frame)) + method + frame)[: rng.randrange(1, 30)]


def statuses(address: str, data: bytes) -> list[int | str]:
    """Every status the server answers ``data`` with, in order; "text" for its line to non-RPC clients."""
    out: list[int | str] = []
    with socket.create_connection(parse_hostport(address), timeout=5) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    if received.startswith(b"this port speaks"):
        return ["text"]
    while len(received) >= HEAD.size:
        magic, status, size = HEAD.unpack_from(received)
        assert magic == b"Rp", received[:40]
        out.append(status)
        received = received[HEAD.size + size :]
    return out


def test_hundreds_of_malformed_connections_change_nothing(serve):
    handler = Counting()
    _, address = serve({"echo": handler}, max_body_bytes=1 << 20, hello_timeout_s=2)
    rng = random.Random(11)
    sent_well_formed = 0
    for _ in range(CONNECTIONS):
        data, authorized = hello(rng)
        stream = [request(rng) for _ in range(rng.randrange(0, 4))]
        answers = statuses(address, data + b"".join(stream))
        if not authorized:
            assert answers in ([], ["text"], [401], [400]), answers
            continue
        assert answers[0] == 200, answers  # the Welcome
        assert set(answers[1:]) <= {200, 400, 404, 413}, answers
        sent_well_formed += answers[1:].count(200)
    assert sent_well_formed > 20
    assert len(handler.calls) == sent_well_formed, "a handler ran exactly for each request answered 200"
    assert all(type(m) in (Ping, Pong, Echo) for m in handler.calls)

    async def go():
        async with RpcClient([address], TOKEN) as client:
            return await client.call("echo", [Pong(1, 2)])

    assert asyncio.run(go()) == [Pong(1, 2)]
