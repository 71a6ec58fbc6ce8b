"""The controller's side: call a method on every rank of a worker group at once and gather the replies.

``call(method, requests)`` sends ``requests[i]`` to rank ``i`` concurrently and returns the replies in
rank order. When a rank fails, the others get ``failure_grace_s`` to finish (their failures are often
the same collective breaking); whatever is still running then is cancelled and awaited, so no request
outlives the call. The lowest rank's error is raised; the others are in its ``others`` and in its notes.

Connections (``transport.py``) stay open between calls: each carries one call at a time, and a rank gets
a second one only while its first is busy, so calls one after another reuse one connection per rank. A
connection is opened (TCP, then the hello with the token) within ``connect_timeout_s``; a whole call,
waiting for a free connection included, within ``timeout_s``. A call that fails, times out or is cancelled
closes its connection: its reply may still come. An idle connection the server closed is never reused.

There are no retries: a trainer call is not idempotent, and a request that timed out may have run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import TracebackType
from typing import Any

from hpcrl.net import parse_hostport
from hpcrl.rpc.connection import Connection, connect
from hpcrl.rpc.errors import (
    BY_STATUS,
    PayloadTooLargeError,
    RemoteError,
    RpcConnectionError,
    RpcError,
    RpcTimeoutError,
    UnknownMethodError,
)
from hpcrl.rpc.messages import Ack, ErrorReply, Welcome
from hpcrl.rpc.transport import HEAD, METHOD_NAME, REPLY, SHUTDOWN, frame_size, hello, read_body, request_parts
from hpcrl.rpc.wire import Buffer, DecodeError, decode, encode_parts


@dataclasses.dataclass
class _Channel:
    """An open, authenticated connection to one rank, and what its server said it takes."""

    conn: Connection
    welcome: Welcome


class RpcClient:
    def __init__(
        self,
        addresses: list[str],
        token: str,
        timeout_s: float = 600.0,
        *,
        connect_timeout_s: float = 10.0,
        failure_grace_s: float = 5.0,
        max_reply_bytes: int = 8 << 30,
        max_connections: int = 100,  # calls in flight at once, all ranks together; more wait
    ):
        if not addresses:
            raise ValueError("RpcClient needs at least one address (host:port of rank 0, 1, ...)")
        for address in addresses:
            parse_hostport(address)  # raises a ValueError naming the bad address
        if not token:
            raise ValueError("token must not be empty; read it with hpcrl.rpc.auth.read_token(run_dir)")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.addresses, self.timeout_s = list(addresses), timeout_s
        self.failure_grace_s, self.max_reply_bytes = failure_grace_s, max_reply_bytes
        self._hello, self._connect_timeout_s = hello(token), connect_timeout_s
        self.max_connections = max_connections
        self._slots: asyncio.Semaphore | None = None  # set while open
        self._idle: list[list[_Channel]] = [[] for _ in self.addresses]

    async def __aenter__(self) -> RpcClient:
        self._slots = asyncio.Semaphore(self.max_connections)
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._slots = None
        for idle in self._idle:
            for channel in idle:
                channel.conn.close()
            idle.clear()

    async def call(self, method: str, requests: list[Any]) -> list[Any]:
        """Send ``requests[i]`` to rank ``i``, all at once; the replies in rank order."""
        if len(requests) != len(self.addresses):
            raise ValueError(
                f"{method}: got {len(requests)} requests for {len(self.addresses)} ranks; pass one per rank"
            )
        return await self._fan_out(method, [encode_parts(r) for r in requests])

    async def broadcast(self, method: str, request: Any) -> list[Any]:
        """Send the same request to every rank (encoded once); the replies in rank order."""
        return await self._fan_out(method, [encode_parts(request)] * len(self.addresses))

    async def broadcast_each(self, method: str, request: Any) -> list[Any]:
        """Send the same request to every rank; each rank's reply or its error, in rank order. Unlike ``call``,
        one rank's failure cuts no other short: for probes whose every answer counts (leases)."""
        self._check_open(method)
        parts = encode_parts(request)
        calls = [self._one(rank, method, parts) for rank in range(len(self.addresses))]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    async def shutdown(self) -> None:
        """Ask every rank to stop its server once its queued handlers are done."""
        await self.broadcast(SHUTDOWN, Ack())

    def _check_open(self, method: str) -> None:
        if self._slots is None:
            raise RuntimeError("RpcClient is not open; use it as `async with RpcClient(...) as client:`")
        if not METHOD_NAME.match(method):
            raise ValueError(f"RPC method names must match {METHOD_NAME.pattern}, got {method!r}")

    # --- one fan-out ------------------------------------------------------------------------------------

    async def _fan_out(self, method: str, frames: list[list[Buffer]]) -> list[Any]:
        self._check_open(method)
        if len(frames) == 1:  # nothing to wait for beside it: no task of its own (a tenth of a no-op call)
            return [await self._one(0, method, frames[0])]
        tasks = [
            asyncio.create_task(self._one(rank, method, parts), name=f"rpc-{method}-rank{rank}")
            for rank, parts in enumerate(frames)
        ]
        try:
            _, running = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if running:  # some rank failed: give the others a moment to report their own errors
                await asyncio.wait(running, timeout=self.failure_grace_s)
        finally:  # on failure, or when the caller is cancelled: no request is left running
            pending = [t for t in tasks if not t.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return self._results(tasks)

    def _results(self, tasks: list[asyncio.Task]) -> list[Any]:
        errors = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
        if not errors:
            return [t.result() for t in tasks]
        first, others = errors[0], errors[1:]
        if isinstance(first, RpcError):
            first.others = others
        for error in others:
            first.add_note(f"also failed: {str(error).splitlines()[0]}")
        cancelled = [rank for rank, t in enumerate(tasks) if t.cancelled()]
        if cancelled:
            first.add_note(
                f"ranks {cancelled} had not replied {self.failure_grace_s} s after the failure; their requests "
                "were cancelled here, but their handlers may still be running"
            )
        raise first

    # --- one call to one rank ---------------------------------------------------------------------------

    async def _one(self, rank: int, method: str, parts: list[Buffer]) -> Any:
        assert self._slots is not None
        address, started = self.addresses[rank], time.time()
        try:
            async with asyncio.timeout(self.timeout_s), self._slots:
                channel = await self._channel(rank, method)
                status, body = await self._exchange(channel, rank, method, parts)
        except RpcError:
            raise
        except TimeoutError as e:
            raise RpcTimeoutError(rank, address, method, started, self.timeout_s) from e
        except OSError as e:  # ConnectionError among them
            raise RpcConnectionError(rank, address, method, f"{type(e).__name__}: {e}") from e
        return self._reply(rank, method, status, body)

    async def _exchange(self, channel: _Channel, rank: int, method: str, parts: list[Buffer]) -> tuple[int, Buffer]:
        """Send one request on the channel and read its reply; the channel goes back to the pool only after a
        whole exchange whose server keeps the connection."""
        self._precheck(channel.welcome, rank, method, frame_size(parts))
        kept = False
        try:
            await channel.conn.send(request_parts(method, parts))
            status, body = await self._read_reply(channel.conn, rank, method)
            kept = status in (200, 400, 500)  # the server closes after any other refusal
        finally:
            if kept and self._slots is not None and channel.conn.usable:
                self._idle[rank].append(channel)
            else:
                channel.conn.close()
        return status, body

    def _precheck(self, welcome: Welcome, rank: int, method: str, size: int) -> None:
        """What the server would refuse on the header alone, refused here: its body is never sent."""
        address = self.addresses[rank]
        if method not in welcome.methods:
            message = f"UnknownMethod: no RPC method {method!r}; this server has {welcome.methods}"
            raise UnknownMethodError(rank, address, method, message, 404)
        if size > welcome.max_body_bytes:
            message = (
                f"PayloadTooLarge: body of {size} bytes is over this server's limit of {welcome.max_body_bytes} "
                "(max_body_bytes)"
            )
            raise PayloadTooLargeError(rank, address, method, message, 413)

    async def _channel(self, rank: int, method: str) -> _Channel:
        """An idle connection to the rank, or a new one."""
        idle = self._idle[rank]
        while idle:
            channel = idle.pop()
            if channel.conn.usable:
                return channel
            channel.conn.close()
        address = self.addresses[rank]
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                conn = await connect(*parse_hostport(address))
                try:
                    return _Channel(conn, await self._greet(conn, rank, method))
                except BaseException:
                    conn.close()
                    raise
        except TimeoutError as e:
            message = f"could not connect within {self._connect_timeout_s} s (connect_timeout_s)"
            raise RpcConnectionError(rank, address, method, message) from e

    async def _greet(self, conn: Connection, rank: int, method: str) -> Welcome:
        await conn.send([self._hello])
        status, body = await self._read_reply(conn, rank, method)
        if status != 200:
            self._reply(rank, method, status, body)  # raises the server's refusal (401: AuthError)
        try:
            return decode(body, Welcome)
        except DecodeError as e:
            raise RpcError(rank, self.addresses[rank], method, f"the server's welcome did not decode: {e}") from None

    async def _read_reply(self, conn: Connection, rank: int, method: str) -> tuple[int, Buffer]:
        magic, status, length = HEAD.unpack(await conn.read_exactly(HEAD.size))
        address = self.addresses[rank]
        if magic != REPLY:
            raise RpcError(rank, address, method, f"not an RPC reply (it began {magic!r}); is this an RPC port?")
        if length > self.max_reply_bytes:
            message = f"reply of {length} bytes is over max_reply_bytes={self.max_reply_bytes}"
            raise RpcError(rank, address, method, message, status)
        return status, await read_body(conn, length)

    def _reply(self, rank: int, method: str, status: int, body: Buffer) -> Any:
        address = self.addresses[rank]
        if status == 200:
            try:
                return decode(body)
            except DecodeError as e:
                raise RpcError(rank, address, method, f"the reply did not decode: {e}", status) from None
        try:
            error = decode(body, ErrorReply)
        except DecodeError:
            text = bytes(body[:300]).decode("utf-8", "replace")
            raise RpcError(rank, address, method, f"unexpected reply {text!r}", status) from None
        if status == 500:
            said = f" (the server there says it is rank {error.rank})" if error.rank != rank else ""
            raise RemoteError(rank, address, method, error.error_type, error.message + said, error.traceback)
        raise BY_STATUS.get(status, RpcError)(rank, address, method, f"{error.error_type}: {error.message}", status)
