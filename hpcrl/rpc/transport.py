"""What client and server share about the RPC's own framing on a long-lived TCP connection.

A connection starts with the client's hello; the token is checked once, for the connection's life::

    hello    magic b"HRPT" (4 bytes), version u16 (1), token length T u16 (at most MAX_TOKEN_BYTES), T bytes
    reply    status 200 and a Welcome frame (rank, methods, max_body_bytes), or 401 / 400 and the server closes

then requests and replies alternate, one request in flight per connection (integers big-endian)::

    request  b"Rq", method length M u16 (1..128), body length B u64, M bytes of method name, B bytes
    reply    b"Rp", status u16, body length B u64, B bytes

A body is one ``wire`` frame: the request message, the reply message (status 200), or an ErrorReply
(400 bad request, 401 token, 404 unknown method, 413 too large, 500 the handler raised). Frames are
written as the list of buffers ``wire.encode_parts`` returns and read into one buffer that the decoded
tensors then share (``buffers.py``), without copies on either side (``connection.py``).

The Welcome tells the client what the server would refuse on a request's header alone (an unknown
method, a body over ``max_body_bytes``), so the client refuses those itself and never sends such a body.
A server still checks both before it reads a body, refuses, and closes the connection.
"""

from __future__ import annotations

import re
import struct

from hpcrl.rpc.buffers import RECEIVE_POOL
from hpcrl.rpc.connection import Connection
from hpcrl.rpc.wire import Buffer

HELLO = struct.Struct(">4sHH")
HELLO_MAGIC = b"HRPT"
TRANSPORT_VERSION = 1
MAX_TOKEN_BYTES = 1024
HEAD = struct.Struct(">2sHQ")  # a request's or a reply's header
REQUEST, REPLY = b"Rq", b"Rp"
SHUTDOWN = "shutdown"
METHOD_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
MAX_METHOD_BYTES = 128


def hello(token: str) -> bytes:
    raw = token.encode("utf-8")
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"the token is {len(raw)} bytes; the RPC takes at most {MAX_TOKEN_BYTES}")
    return HELLO.pack(HELLO_MAGIC, TRANSPORT_VERSION, len(raw)) + raw


def request_parts(method: str, parts: list[Buffer]) -> list[Buffer]:
    name = method.encode("ascii")
    return [HEAD.pack(REQUEST, len(name), frame_size(parts)) + name, *parts]


def reply_parts(status: int, parts: list[Buffer]) -> list[Buffer]:
    return [HEAD.pack(REPLY, status, frame_size(parts)), *parts]


def frame_size(parts: list[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


async def read_body(conn: Connection, length: int) -> memoryview:
    """Exactly ``length`` bytes in one writable buffer (from the pool when it is large)."""
    buf = RECEIVE_POOL.take(length)
    await conn.read_into(buf)
    return buf
