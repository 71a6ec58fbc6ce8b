"""One TCP connection on the event loop, without asyncio's transports: reads land in the caller's buffer, writes
leave from the caller's buffers.

asyncio's stream transport copies what the kernel did not take at once into its own buffer, and (Python 3.11)
moves the rest of that buffer down after every send: for a tensor of 64 MiB that is one more copy of the
payload and many moves of megabytes. Here the socket is non-blocking with a reader callback registered for
the connection's life: a read of a large body (``read_into``) receives straight into its buffer, small reads
(``read_exactly``) come out of a 64 KiB scratch buffer, and ``send`` hands the frame's buffers to ``sendmsg``
as they are, waiting for the socket to be writable whenever the kernel's buffer is full. A server's connection starts
with a scratch buffer just large enough for the hello and grows it once the peer is authenticated
(``grow_scratch``): one that never says hello holds about 1 KiB of it, not 64 KiB. While a large read
waits, the socket's SO_RCVLOWAT is the bytes still missing (at most ``LOWAT_BYTES``): the kernel wakes the
event loop once that much has arrived, not for each 64 KiB segment, each wake-up a turn of the event loop
(this halved a 1 MiB call's CPU time on the receiving side, on 2 cores). One coroutine reads
and one writes at a time (the RPC sends one request per connection at a time). When nobody reads, at most the
scratch buffer's worth is taken from the socket; then reading pauses until someone does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Sequence

from hpcrl.rpc.wire import Buffer

SCRATCH_BYTES = 64 << 10  # the most a small read may ask for, and what is read ahead of a reader
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX"))  # buffers one sendmsg takes
LOWAT_BYTES = 1 << 20  # the most a large read waits to have arrived before the event loop is woken


class ConnectionEnded(ConnectionError):
    """The peer closed the connection, it broke, or this side closed it, before a read was complete."""


class Connection:
    def __init__(self, sock: socket.socket, scratch_bytes: int = SCRATCH_BYTES):
        self._loop = asyncio.get_running_loop()
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a reply's header must not wait
        self._sock, self._fd = sock, sock.fileno()
        self.peer = _peer(sock)
        self._scratch = memoryview(bytearray(scratch_bytes))
        self._start = self._end = 0  # unread bytes are scratch[start:end]
        self._target: memoryview | None = None  # a read_into's buffer, while the scratch buffer is empty
        self._filled = 0
        self._want = 0  # bytes a read_exactly waits for in the scratch buffer
        self._waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None
        self._ended: str | None = None  # why no more bytes will come
        self._closed = self._reading = False
        self._close_lock = threading.Lock()  # send_nowait (another thread) never writes to a closed socket
        self._lowat = 1  # the socket's SO_RCVLOWAT; 0 where the socket has none (not TCP)
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or not hasattr(socket, "SO_RCVLOWAT"):
            self._lowat = 0
        self._resume_reading()

    @property
    def usable(self) -> bool:
        """Neither closed here nor ended by the peer (an idle connection whose server went away is not)."""
        return not self._closed and self._ended is None

    # --- reading ----------------------------------------------------------------------------------------

    async def read_exactly(self, n: int) -> bytes:
        """The next ``n`` bytes (at most SCRATCH_BYTES); ConnectionEnded if the connection ends first."""
        if n > len(self._scratch):
            raise ValueError(f"read_exactly reads at most {len(self._scratch)} bytes, asked for {n}")
        while self._end - self._start < n:
            self._raise_if_ended(self._end - self._start, n)
            self._want = n
            await self._wait()
        out = bytes(self._scratch[self._start : self._start + n])
        self._consumed(n)
        return out

    def grow_scratch(self, n: int) -> None:
        """Let small reads, and what is read ahead of them, take up to ``n`` bytes; what is unread is kept.
        Not while a read waits."""
        if n <= len(self._scratch):
            return
        unread = self._end - self._start
        bigger = memoryview(bytearray(n))
        bigger[:unread] = self._scratch[self._start : self._end]
        self._scratch, self._start, self._end = bigger, 0, unread

    async def read_into(self, buf: memoryview) -> None:
        """Fill ``buf`` with the next ``len(buf)`` bytes; most of a large one is received into it directly."""
        take = min(len(buf), self._end - self._start)
        buf[:take] = self._scratch[self._start : self._start + take]
        self._consumed(take)
        if take == len(buf):
            return
        self._target, self._filled = buf, take  # the scratch buffer is empty now
        self._set_lowat(len(buf) - take)
        try:
            while self._filled < len(buf):
                self._raise_if_ended(self._filled, len(buf))
                await self._wait()
        finally:
            self._target = None
            self._set_lowat(1)

    async def _wait(self) -> None:
        self._resume_reading()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _consumed(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0

    def _raise_if_ended(self, have: int, want: int) -> None:
        if self._ended is not None:
            raise ConnectionEnded(f"{self._ended} (after {have} of {want} bytes)")

    def _on_readable(self) -> None:
        if self._target is not None:
            view = self._target[self._filled :]
        else:
            if self._end == len(self._scratch):
                if self._start == 0:  # full, and nobody has asked for it: wait for a reader
                    self._pause_reading()
                    return
                rest = self._end - self._start
                self._scratch[:rest] = self._scratch[self._start : self._end]
                self._start, self._end = 0, rest
            view = self._scratch[self._end :]
        try:
            n = self._sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._end_with(f"{type(e).__name__}: {e}")
            return
        if n == 0:
            self._end_with("the peer closed the connection")
            return
        if self._target is not None:
            self._filled += n
            missing = len(self._target) - self._filled
            done = missing == 0
            if 0 < missing < self._lowat:  # never wait for more than will come
                self._set_lowat(missing)
        else:
            self._end += n
            done = self._end - self._start >= self._want
        if done:
            self._wake()

    def _set_lowat(self, n: int) -> None:
        n = max(1, min(n, LOWAT_BYTES))
        if self._lowat and n != self._lowat and not self._closed:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
                self._lowat = n
            except OSError:  # not supported here: every segment wakes the loop, as without it
                self._lowat = 0

    def _end_with(self, why: str) -> None:
        if self._ended is None:
            self._ended = why
        self._pause_reading()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _resume_reading(self) -> None:
        if not self._reading and self._ended is None and not self._closed:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    # --- writing ----------------------------------------------------------------------------------------

    async def send(self, parts: Sequence[Buffer]) -> None:
        """Write the buffers in order, without copying them; returns once the kernel has taken every byte."""
        views = _views(parts)
        while views:
            if self._closed:
                raise ConnectionEnded("the connection was closed here")
            views = self._send_some(views)
            if views:
                await self._writable()

    def send_nowait(self, parts: Sequence[Buffer]) -> list[memoryview]:
        """From any thread: write what the socket takes at once; what is left, for ``send`` on the event loop.
        Only while nothing else writes on this connection (the server's handler thread, for the one request in
        flight on it). A socket that fails or was closed is left to ``send`` to report."""
        views = _views(parts)
        with self._close_lock:
            if self._closed:
                return views
            try:
                return self._send_some(views)
            except OSError:
                return views

    def _send_some(self, views: list[memoryview]) -> list[memoryview]:
        """Send until the socket would block; the views not yet sent."""
        i = 0
        while i < len(views):
            try:
                n = self._sock.sendmsg(views[i : i + IOV_MAX])
            except (BlockingIOError, InterruptedError):
                break
            while n:
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i], n = views[i][n:], 0
        return views[i:]

    async def _writable(self) -> None:
        self._write_waiter = self._loop.create_future()
        self._loop.add_writer(self._fd, self._on_writable)
        try:
            await self._write_waiter
        finally:
            self._write_waiter = None
            if not self._closed:
                self._loop.remove_writer(self._fd)

    def _on_writable(self) -> None:
        if self._write_waiter is not None and not self._write_waiter.done():
            self._write_waiter.set_result(None)

    # --- ending -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the socket now; a read or write waiting on it raises ConnectionEnded."""
        if self._closed:
            return
        self._pause_reading()
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_writer(self._fd)
        with self._close_lock:
            self._closed = True
            self._sock.close()
        self._end_with("the connection was closed here")
        self._on_writable()

    async def close_after_reply(self, linger_s: float) -> None:
        """Close once what was sent is on its way: stop writing, throw away what the peer still sends, up to
        ``linger_s``. Closing with unread bytes would reset the connection, and a reset can destroy the reply
        (a refusal) in flight before the peer reads it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        try:
            async with asyncio.timeout(linger_s):
                while self._ended is None:
                    self._start = self._end = 0  # discarded
                    self._want = len(self._scratch)
                    await self._wait()
        except TimeoutError:
            pass
        finally:
            self.close()


async def connect(host: str, port: int) -> Connection:
    """A connection to ``host:port`` (a name or an IPv4/IPv6 address), trying each address it resolves to."""
    loop = asyncio.get_running_loop()
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:  # a host name: resolved off the event loop
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as e:
            sock.close()
            error = e
            continue
        except BaseException:
            sock.close()
            raise
        return Connection(sock)
    raise error or OSError(f"{host} resolved to no address")


def _views(parts: Sequence[Buffer]) -> list[memoryview]:
    return [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]


def _peer(sock: socket.socket) -> str:
    try:
        address = sock.getpeername()
    except OSError:
        return "?"
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
