"""Real RPC servers on loopback, in threads of the test process, and helpers to compare messages."""

from __future__ import annotations

import dataclasses
import socket
import tempfile
import threading
import types
import typing
from typing import Any

import pytest
import torch
from hypothesis.configuration import set_hypothesis_home_dir

from hpcrl.net import parse_hostport
from hpcrl.rpc import RpcServer
from hpcrl.rpc.fields import field_types
from hpcrl.rpc.messages import LogprobsResult, SequenceBatch, SequenceData
from hpcrl.rpc.transport import HEAD, HELLO

TOKEN = "test-token-" + "x" * 32
# hypothesis caches constants under ./.hypothesis even without an example database: keep the checkout clean
set_hypothesis_home_dir(f"{tempfile.gettempdir()}/hpcrl-hypothesis")


class Counting:
    """A handler that records every message it was called with (on the handler thread)."""

    def __init__(self, reply: Any = None):
        self.calls: list[Any] = []
        self.threads: set[str] = set()
        self.reply = reply

    def __call__(self, msg: Any) -> Any:
        self.calls.append(msg)
        self.threads.add(threading.current_thread().name)
        return msg if self.reply is None else self.reply


@pytest.fixture
def serve():
    """``serve(handlers, rank=0, host=..., **kw) -> (server, address)``; every server is stopped at teardown."""
    servers: list[RpcServer] = []

    def start(handlers: dict, rank: int = 0, host: str = "127.0.0.1", **kw: Any) -> tuple[RpcServer, str]:
        server = RpcServer(handlers, kw.pop("token", TOKEN), rank, host=host, **kw)
        servers.append(server)
        return server, server.start_in_thread(timeout_s=30)

    yield start
    for server in servers:
        server.stop()
    for server in servers:
        server.serve_until_stopped(timeout_s=30)


class RawConnection:
    """hpcrl's RPC transport spoken by hand over a blocking socket, to send what ``RpcClient`` never would."""

    def __init__(self, address: str, timeout_s: float = 30.0):
        self.sock = socket.create_connection(parse_hostport(address), timeout=timeout_s)

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def hello(self, token: str = TOKEN) -> tuple[int, bytes]:
        """Send the hello; the server's reply (200 and a Welcome, or a refusal)."""
        self.sock.sendall(HELLO.pack(b"HRPT", 1, len(token.encode())) + token.encode())
        return self.reply()

    def request(self, method: str, body: bytes, declared: int | None = None) -> None:
        """A request header (with ``declared`` as the body's length if given) and then ``body``."""
        name = method.encode()
        size = len(body) if declared is None else declared
        self.sock.sendall(HEAD.pack(b"Rq", len(name), size) + name + body)

    def reply(self) -> tuple[int, bytes]:
        magic, status, size = HEAD.unpack(self.exactly(HEAD.size))
        assert magic == b"Rp", magic
        return status, self.exactly(size)

    def exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, f"the connection ended after {len(data)} of {n} bytes"
            data += chunk
        return data

    def closed_by_server(self) -> bool:
        """Whether the server closed the connection (reading nothing more but the end)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def sample(ann: Any, seed: int = 0) -> Any:
    """A value of every annotation a message may use, with some variety from ``seed``."""
    if ann is int:
        return 7 + seed
    if ann is float:
        return 0.5 + seed
    if ann is str:
        return f"text-{seed}-é"
    if ann is bool:
        return seed % 2 == 0
    if ann is torch.Tensor:
        return torch.arange(6 + seed, dtype=torch.float32).reshape(-1, 1).bfloat16()
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (types.UnionType, typing.Union):
        inner = next(a for a in args if a is not type(None))
        return None if seed % 3 == 2 else sample(inner, seed)
    if origin is list:
        return [sample(args[0], seed + i) for i in range(2)]
    if origin is dict:
        return {f"k{i}": sample(args[1], seed + i) for i in range(2)}
    if ann is SequenceBatch:  # checked on construction: packed from sequences of different lengths
        return SequenceBatch.pack([_sequence(3 + seed + i, seed) for i in range(2)])
    if isinstance(ann, type) and issubclass(ann, LogprobsResult):  # checked on construction too (ValuesResult)
        return ann.of([[-0.25 * (i + seed) for i in range(3 + seed + k)] for k in range(2)])
    return ann(**{name: sample(t, seed) for name, t in field_types(ann).items()})


def _sequence(length: int, seed: int) -> SequenceData:
    logprobs = None if seed % 3 == 2 else [-0.25 * (i + seed) for i in range(length)]
    ids, mask = [7 + seed + i for i in range(length)], [0] + [1] * (length - 1)
    return SequenceData(ids, mask, 0.5 + seed, logprobs, logprobs, None, [seed] * length)


def assert_same(a: Any, b: Any, path: str = "msg") -> None:
    """Equal values, with tensors compared bit for bit and by dtype and shape."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert _bytes(a) == _bytes(b), f"{path}: tensor bytes differ"
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()
