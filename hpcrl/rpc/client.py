"""The controller's side: call a method on every rank of a worker group at once and gather the replies.

``call(method, requests)`` sends ``requests[i]`` to rank ``i`` concurrently and returns the replies in
rank order. When a rank fails, the others get ``failure_grace_s`` to finish (their failures are often
the same collective breaking); whatever is still running then is cancelled and awaited, so no request
outlives the call. The lowest rank's error is raised; the others are in its ``others`` and in its notes.

There are no retries: a trainer call is not idempotent, and a request that timed out may have run.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import hdrs

from hpcrl.net import parse_hostport
from hpcrl.rpc.errors import BY_STATUS, RemoteError, RpcConnectionError, RpcError
from hpcrl.rpc.messages import Ack, ErrorReply
from hpcrl.rpc.transport import METHOD_NAME, SHUTDOWN, FramePayload, read_body
from hpcrl.rpc.wire import Buffer, DecodeError, decode, encode_parts

# A larger body waits for the server's "100 Continue", so a refused request (wrong token, unknown
# method, too large) costs one round trip instead of the whole transfer. Smaller ones skip the wait.
EXPECT_CONTINUE_BYTES = 64 << 10


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
        max_connections: int = 100,  # calls in flight at once, all ranks together (aiohttp's pool); more wait
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
        self._token, self._connect_timeout_s = token, connect_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RpcClient:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self._connect_timeout_s)
        headers = {hdrs.AUTHORIZATION: f"Bearer {self._token}"}
        connector = aiohttp.TCPConnector(limit=self.max_connections)
        self._session = aiohttp.ClientSession(
            connector=connector, headers=headers, timeout=timeout, read_bufsize=1 << 20
        )
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        if self._session is None:
            raise RuntimeError("RpcClient is not open; use it as `async with RpcClient(...) as client:`")
        parts = encode_parts(request)
        calls = [self._one(rank, method, parts) for rank in range(len(self.addresses))]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    async def shutdown(self) -> None:
        """Ask every rank to stop its server once its queued handlers are done."""
        await self.broadcast(SHUTDOWN, Ack())

    # --- one fan-out ------------------------------------------------------------------------------------

    async def _fan_out(self, method: str, frames: list[list[Buffer]]) -> list[Any]:
        if self._session is None:
            raise RuntimeError("RpcClient is not open; use it as `async with RpcClient(...) as client:`")
        if not METHOD_NAME.match(method):
            raise ValueError(f"RPC method names must match {METHOD_NAME.pattern}, got {method!r}")
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

    async def _one(self, rank: int, method: str, parts: list[Buffer]) -> Any:
        assert self._session is not None
        address = self.addresses[rank]
        try:
            payload = FramePayload(parts)
            expect100 = (payload.size or 0) >= EXPECT_CONTINUE_BYTES
            async with self._session.post(f"http://{address}/rpc/{method}", data=payload, expect100=expect100) as r:
                status, body = r.status, await self._read(r, rank, method)
        except RpcError:
            raise
        except TimeoutError as e:
            raise RpcConnectionError(rank, address, method, f"no reply within {self.timeout_s} s") from e
        except (aiohttp.ClientError, OSError) as e:
            raise RpcConnectionError(rank, address, method, f"{type(e).__name__}: {e}") from e
        return self._reply(rank, method, status, body)

    async def _read(self, response: aiohttp.ClientResponse, rank: int, method: str) -> Buffer:
        length = response.content_length
        if length is None:
            return await response.read()
        if length > self.max_reply_bytes:
            message = f"reply of {length} bytes is over max_reply_bytes={self.max_reply_bytes}"
            raise RpcError(rank, self.addresses[rank], method, message, response.status)
        return await read_body(response.content, length)

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
