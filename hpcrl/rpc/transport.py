"""What client and server share about HTTP: the route, headers, and frames written and read without copies.

A request is ``POST /rpc/<method>`` with ``Authorization: Bearer <token>``, a Content-Length and an
encoded frame as its body (``application/octet-stream``); the reply is a frame too, an ErrorReply when
the status is not 200. Frames are written as the list of buffers ``wire.encode_parts`` returns, in
slices so the event loop's send buffer never holds a second copy of a large tensor, and read into one
buffer that the decoded tensors then share (``buffers.py``).
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import StreamReader
from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

from hpcrl.rpc.buffers import RECEIVE_POOL
from hpcrl.rpc.wire import Buffer

ROUTE = "/rpc/{method}"
CONTENT_TYPE = "application/octet-stream"
SHUTDOWN = "shutdown"
METHOD_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
WRITE_SLICE = 4 << 20  # one write's share of the event loop's send buffer


def bearer(header: str | None) -> str | None:
    """The token in an ``Authorization: Bearer <token>`` header, or None."""
    if header is None or not header.startswith("Bearer "):
        return None
    return header[len("Bearer ") :].strip()


def frame_size(parts: list[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


async def write_parts(writer: Any, parts: list[Buffer]) -> None:
    """Write the frame's buffers in order; ``writer.write`` waits whenever the send buffer is full."""
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), WRITE_SLICE):
            await writer.write(view[start : start + WRITE_SLICE])


class FramePayload(Payload):
    """A request body made of a frame's buffers, with its size known up front (for Content-Length)."""

    def __init__(self, parts: list[Buffer]) -> None:
        super().__init__(parts, content_type=CONTENT_TYPE)
        self._size = frame_size(parts)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await write_parts(writer, self._value)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        if content_length is not None and content_length != self._size:
            raise ValueError(f"Content-Length {content_length} does not match the {self._size}-byte frame")
        await write_parts(writer, self._value)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return f"<rpc frame of {self._size} bytes>"


class BodyError(ConnectionError):
    """The body ended before its Content-Length (the peer went away)."""


async def read_body(stream: StreamReader, length: int) -> memoryview:
    """Read exactly ``length`` bytes into one writable buffer (from the pool when it is large)."""
    buf, pos = RECEIVE_POOL.take(length), 0
    while pos < length:
        chunk = await stream.readany()
        if not chunk:
            raise BodyError(f"body ended after {pos} of {length} bytes")
        if pos + len(chunk) > length:
            raise BodyError(f"body is longer than its Content-Length {length}")
        buf[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return buf
