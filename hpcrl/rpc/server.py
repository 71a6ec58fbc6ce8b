"""One RPC endpoint per worker rank, on hpcrl's own framing over TCP (``transport.py``); plain handlers run one
at a time.

Order of checks, each answered with an ErrorReply frame before anything later happens::

    hello: magic, version, token   -> 401   once per connection, before anything else is read: nothing of a
                                            request is read, no handler runs, and nothing tells which
                                            methods exist; the server then closes the connection
    request: method known          -> 404   the reply lists the known methods; the body is not read
    request: body size             -> 413   over ``max_body_bytes``; the body is not read
    body decodes (wire.decode)     -> 400   the DecodeError message; the connection stays usable
    handler(msg) -> reply          -> 500   ErrorReply(rank, method, type, message, traceback)

After a 401, 404 or 413 the server closes the connection (a body it did not read must not be taken for the
next request). ``RpcClient`` never sends such a body: the server's Welcome names its methods and limit, and
the client refuses those calls itself. A connection that has not sent its hello within ``hello_timeout_s``
is closed, and bytes that are not a hello (an HTTP request, say) get one line of text saying what this
port speaks, and the connection is closed.

Connections not yet authenticated are capped: at most ``max_pending_hellos`` wait for their hello (or linger
after their refusal) at once, each with a buffer of about 1 KiB (``HELLO_SCRATCH_BYTES``; 64 KiB once
authenticated). At the cap the server accepts no more, so further connections wait in the kernel's listen
backlog: a burst of legitimate clients (the controller opens up to ``rollout.max_concurrent`` connections to
one rollout worker at once) is slowed by a few milliseconds, not refused. And so that idle connections (a
port scanner's, a stray client's) cannot lock the clients out for the hello timeout, the oldest of them is
closed once it has waited ``crowded_hello_s`` at the cap, to make room: a client sends its hello as soon as
it has connected, so one that has said nothing for a second while others queue behind it is not one. A
client queued behind N idle connections gets in after about N / ``max_pending_hellos`` x ``crowded_hello_s``.
``on_authenticated`` is called (on the event loop) for every connection whose token is right: a worker's
lease learns from it that its controller has reached it (``hpcrl/launch/lease.py``).

Handlers run on one dedicated daemon thread, in the order their requests were decoded: trainer
handlers issue torch collectives, which must run in the same order on every rank. The event loop
keeps answering (and refusing) requests while a handler runs. A coroutine handler (``async def``)
runs on the event loop instead, as its request comes, concurrently with any number of others: for
work that mostly waits (a rollout worker's episodes wait on HTTP); it must not block the loop.
Thread-local state such as the CUDA device is not inherited from the thread that built the server:
pass ``thread_init`` to set it.

``shutdown`` is built in: it runs the ``shutdown`` handler if there is one (after every queued
handler), replies (Ack by default), then stops the server. A torchrun worker typically does::

    server = RpcServer(handlers, read_token(run_dir), rank, host=bind_host, port=port)
    address = server.start_in_thread()   # event loop on a daemon thread
    announce(address)
    server.serve_until_stopped()          # main thread blocks until a shutdown request or stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import socket
import threading
import time
import traceback
import typing
from collections.abc import Callable
from typing import Any

from hpcrl.net import discover_host, family_of, format_hostport, is_ipv6
from hpcrl.rpc import auth
from hpcrl.rpc.connection import SCRATCH_BYTES, Connection, ConnectionEnded
from hpcrl.rpc.handler_thread import Call, HandlerThread
from hpcrl.rpc.messages import MESSAGES, Ack, ErrorReply, Welcome
from hpcrl.rpc.transport import (
    HEAD,
    HELLO,
    HELLO_MAGIC,
    MAX_METHOD_BYTES,
    MAX_TOKEN_BYTES,
    METHOD_NAME,
    REQUEST,
    SHUTDOWN,
    TRANSPORT_VERSION,
    read_body,
    reply_parts,
)
from hpcrl.rpc.wire import Buffer, DecodeError, decode, encode_parts

log = logging.getLogger(__name__)
Handler = Callable[[Any], Any]
_WILDCARDS = ("", "0.0.0.0", "::")
LINGER_S = 2.0  # after a refusal, how long the server drains what the peer still sends before it closes
MAX_PENDING_HELLOS = 64  # connections not yet authenticated at once; more wait in the kernel's listen backlog
CROWDED_HELLO_S = 1.0  # at that cap, how long the oldest may wait for its hello before it is closed to make room
HELLO_SCRATCH_BYTES = HELLO.size + MAX_TOKEN_BYTES  # a connection's read buffer until it is authenticated


class _Refused(Exception):
    """A request refused on its header: the reply is sent, then the connection is closed."""

    def __init__(self, status: int, method: str, error_type: str, message: str):
        super().__init__(message)
        self.status, self.method, self.error_type, self.message = status, method, error_type, message


class RpcServer:
    def __init__(
        self,
        handlers: dict[str, Handler],
        token: str,
        rank: int,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 8 << 30,
        *,
        advertise_host: str | None = None,
        thread_init: Callable[[], None] | None = None,
        shutdown_timeout_s: float = 5.0,
        hello_timeout_s: float = 30.0,
        max_pending_hellos: int = MAX_PENDING_HELLOS,
        crowded_hello_s: float = CROWDED_HELLO_S,
        on_authenticated: Callable[[], None] | None = None,
    ):
        bad = [m for m in handlers if not METHOD_NAME.match(m)]
        if bad:
            raise ValueError(f"RPC method names must match {METHOD_NAME.pattern}, got {bad}")
        if not token:
            raise ValueError("token must not be empty; read it with hpcrl.rpc.auth.read_token(run_dir)")
        if max_pending_hellos < 1:
            raise ValueError(f"max_pending_hellos must be >= 1, got {max_pending_hellos}")
        self.handlers, self.token, self.rank = dict(handlers), token, rank
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.advertise_host, self.thread_init, self.shutdown_timeout_s = advertise_host, thread_init, shutdown_timeout_s
        self.hello_timeout_s = hello_timeout_s
        self.max_pending_hellos, self.crowded_hello_s = max_pending_hellos, crowded_hello_s
        self.on_authenticated = on_authenticated
        self.address: str | None = None  # host:port peers dial, set once listening
        self.connections_accepted = 0  # TCP connections accepted so far (clients keep theirs open)
        self._request_types = {m: _request_type(h) for m, h in self.handlers.items()}
        self._known = sorted([*self.handlers, SHUTDOWN])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._worker: HandlerThread | None = None
        self._tasks: set[asyncio.Task] = set()  # one per open connection
        self._unauthenticated: dict[Connection, float] = {}  # connection -> when accepted, oldest first
        self._authenticated = asyncio.Event()  # set when one leaves _unauthenticated (bound to the loop on first use)
        self._busy = 0  # requests read and not yet answered (the handler thread ends some)
        self._busy_lock = threading.Lock()
        self._init_error: BaseException | None = None  # what thread_init raised: every request gets it (500)

    # --- running ----------------------------------------------------------------------------------------

    def run(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve on the calling thread until ``shutdown`` or ``stop()``; ``on_ready(address)`` once listening."""
        try:
            asyncio.run(self._serve(on_ready or (lambda _: None)))
        finally:
            self._done.set()

    def start_in_thread(self, timeout_s: float = 60.0) -> str:
        """Serve on a daemon thread; return the address once listening, or raise why it could not start."""
        if self._thread is not None:
            raise RuntimeError(f"RPC server of rank {self.rank} was already started")
        ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name=f"rpc-loop-{self.rank}")
        self._thread.daemon = True
        self._thread.start()
        return ready.result(timeout_s)

    def serve_until_stopped(self, timeout_s: float | None = None) -> None:
        """Block until the server has stopped (raising what stopped it, if it failed)."""
        if self._thread is None and not self._done.is_set():
            raise RuntimeError("the RPC server was not started; call start_in_thread() first")
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"RPC server of rank {self.rank} at {self.address} still running after {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"RPC server of rank {self.rank} failed: {self._error!r}") from self._error

    def stop(self) -> None:
        """Ask the server to stop (from any thread); in-flight requests get ``shutdown_timeout_s`` to finish."""
        self._stop_requested = True
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed: nothing left to stop
                loop.call_soon_threadsafe(event.set)

    def __enter__(self) -> RpcServer:
        self.start_in_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._done.wait(self.shutdown_timeout_s + 10)

    def _thread_main(self, ready: concurrent.futures.Future[str]) -> None:
        try:
            asyncio.run(self._serve(ready.set_result))
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            else:
                log.exception("RPC server of rank %d stopped with an error", self.rank)
                self._error = e
        finally:
            self._done.set()

    async def _serve(self, on_ready: Callable[[str], None]) -> None:
        listener = _listen(self.host, self.port)
        self._worker = HandlerThread(f"rpc-handler-{self.rank}", self._init_handler_thread)
        accepting = asyncio.create_task(self._accept(listener), name=f"rpc-accept-{self.rank}")
        try:
            self._loop, self._stop_event = asyncio.get_running_loop(), asyncio.Event()
            self.address = format_hostport(self._advertised_host(), listener.getsockname()[1])
            log.info("RPC server of rank %d listening on %s (bound %s)", self.rank, self.address, self.host)
            on_ready(self.address)
            if not self._stop_requested:
                await self._stop_event.wait()
        finally:
            accepting.cancel()
            await asyncio.gather(accepting, return_exceptions=True)
            listener.close()
            await self._finish_requests()
            self._worker.stop()
            log.info("RPC server of rank %d stopped", self.rank)

    async def _finish_requests(self) -> None:
        """Give requests in flight ``shutdown_timeout_s`` to be answered, then close every connection."""
        deadline = time.monotonic() + self.shutdown_timeout_s
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._busy:
            log.warning("RPC server of rank %d: %d requests still running at shutdown", self.rank, self._busy)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def pending_hellos(self) -> int:
        """Connections accepted and not yet authenticated (waiting for their hello, or refused and lingering)."""
        return len(self._unauthenticated)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._room_for_a_hello()
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:  # out of file descriptors, say: the connections already open go on
                log.warning("RPC server of rank %d could not accept a connection: %r", self.rank, e)
                await asyncio.sleep(0.1)
                continue
            try:
                conn = Connection(sock, HELLO_SCRATCH_BYTES)
            except OSError as e:  # reset by the peer already, say
                log.debug("RPC connection ended as it was accepted: %r", e)
                sock.close()
                continue
            self.connections_accepted += 1
            self._unauthenticated[conn] = time.monotonic()
            task = asyncio.create_task(self._serve_connection(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _room_for_a_hello(self) -> None:
        """Return once fewer than ``max_pending_hellos`` connections are unauthenticated; at the cap, the oldest
        is closed once it has waited ``crowded_hello_s`` (module doc)."""
        while len(self._unauthenticated) >= self.max_pending_hellos:
            oldest, accepted = next(iter(self._unauthenticated.items()))
            wait_s = accepted + self.crowded_hello_s - time.monotonic()
            if wait_s <= 0:
                log.warning(
                    "closed a connection from %s: no hello within %.1f s while %d connections waited for theirs "
                    "(max_pending_hellos)",
                    oldest.peer,
                    time.monotonic() - accepted,
                    len(self._unauthenticated),
                )
                self._authenticated_or_gone(oldest)
                oldest.close()  # its hello's read raises ConnectionEnded: the connection's task ends
                continue
            self._authenticated.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._authenticated.wait()

    def _authenticated_or_gone(self, conn: Connection) -> None:
        """``conn`` no longer counts against ``max_pending_hellos``."""
        if self._unauthenticated.pop(conn, None) is not None:
            self._authenticated.set()

    def _advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return discover_host(family_of(self.host or "0.0.0.0")) if self.host in _WILDCARDS else self.host

    # --- one connection ---------------------------------------------------------------------------------

    async def _serve_connection(self, conn: Connection) -> None:
        previous = _InFlight()
        try:
            if await self._greet(conn):
                while await self._serve_request(conn, previous):
                    pass
        except asyncio.CancelledError:  # the server stops: a handler the thread has not started will not run
            previous.cancel()
            raise
        except _Refused as refusal:
            await self._refuse(conn, refusal)
        except ConnectionError as e:  # the peer went away (mid-body, say): there is no one to answer
            log.debug("RPC connection from %s ended: %s", conn.peer, e)
        except Exception as e:  # a bug here, not in a handler: still answer with a typed error
            log.exception("RPC server of rank %d failed on a request from %s", self.rank, conn.peer)
            await self._refuse(conn, _Refused(500, "", type(e).__name__, f"the RPC server failed: {e}"))
        finally:
            self._authenticated_or_gone(conn)
            conn.close()

    async def _greet(self, conn: Connection) -> bool:
        """The hello: magic, version, then the token; a Welcome when it is right. False: closed."""
        try:
            async with asyncio.timeout(self.hello_timeout_s):
                magic, presented = await self._read_hello(conn)
        except TimeoutError:
            log.warning("closed a connection from %s: no hello within %g s", conn.peer, self.hello_timeout_s)
            return False
        if magic != HELLO_MAGIC:
            return await self._not_rpc(conn, magic)
        if not auth.check(presented, self.token):
            log.warning("refused a connection from %s: missing or wrong token", conn.peer)
            message = "missing or wrong token; the client must present the run's <run_dir>/secret"
            raise _Refused(401, "", "AuthError", message)
        if self.on_authenticated is not None:
            self.on_authenticated()
        self._authenticated_or_gone(conn)
        conn.grow_scratch(SCRATCH_BYTES)
        await conn.send(reply_parts(200, encode_parts(Welcome(self.rank, self._known, self.max_body_bytes))))
        return True

    async def _read_hello(self, conn: Connection) -> tuple[bytes, str | None]:
        """The magic and the token presented (None when it is longer than any token); reads nothing more."""
        magic, version, length = HELLO.unpack(await conn.read_exactly(HELLO.size))
        if magic != HELLO_MAGIC:
            return magic, None
        if version != TRANSPORT_VERSION:
            message = f"RPC transport version {version} is not spoken here; this server speaks {TRANSPORT_VERSION}"
            raise _Refused(400, "", "VersionError", message)
        if length > MAX_TOKEN_BYTES:
            return magic, None
        return magic, (await conn.read_exactly(length)).decode("utf-8", "surrogateescape")

    async def _not_rpc(self, conn: Connection, first: bytes) -> bool:
        log.warning("closed a connection from %s: it does not speak hpcrl's RPC (it began %r)", conn.peer, first)
        text = "this port speaks hpcrl's RPC (hpcrl.rpc.RpcClient), not HTTP or anything else\n"
        await conn.send([text.encode()])
        await conn.close_after_reply(LINGER_S)
        return False

    async def _serve_request(self, conn: Connection, previous: _InFlight) -> bool:
        """Read, check and run one request (a plain handler answers it from the handler thread, while this
        coroutine goes on to wait for the next request). False when the connection should close."""
        try:
            head = await conn.read_exactly(HEAD.size)
        except ConnectionError:  # between requests: the client closed its connection (or half: it still reads)
            await previous.answered()
            return False
        await previous.answered()  # one request at a time: the previous reply has left before this one is read
        magic, name_len, size = HEAD.unpack(head)
        method = await self._method(conn, magic, name_len)
        if size > self.max_body_bytes:
            message = f"body of {size} bytes is over this server's limit of {self.max_body_bytes} (max_body_bytes)"
            raise _Refused(413, method, "PayloadTooLarge", message)
        self._count_busy(1)
        handed_off = False
        try:
            body = await read_body(conn, size)
            try:
                msg = decode(body, self._request_types.get(method))
            except DecodeError as e:
                await self._send(conn, 400, ErrorReply(self.rank, method, "DecodeError", str(e), ""))
                return True
            del body  # the message holds what it needs; the buffer goes back to its pool with it
            handed_off = await self._answer(conn, method, self.handlers.get(method, _acknowledge), msg, previous)
        finally:
            if not handed_off:
                self._count_busy(-1)
        if method == SHUTDOWN:
            await previous.answered()
            log.info("shutdown requested by %s", conn.peer)
            self.stop()
            return False
        return True

    def _count_busy(self, n: int) -> None:
        with self._busy_lock:  # the handler thread ends the requests it answers
            self._busy += n

    async def _method(self, conn: Connection, magic: bytes, name_len: int) -> str:
        if magic != REQUEST or not 1 <= name_len <= MAX_METHOD_BYTES:
            message = f"not a request header (magic {magic!r}, method name of {name_len} bytes)"
            raise _Refused(400, "", "BadRequest", message)
        method = (await conn.read_exactly(name_len)).decode("ascii", "replace")
        if method not in self.handlers and method != SHUTDOWN:
            message = f"no RPC method {method!r}; this server has {self._known}"
            raise _Refused(404, method, "UnknownMethod", message)
        return method

    async def _answer(self, conn: Connection, method: str, handler: Handler, msg: Any, flight: _InFlight) -> bool:
        """Run the handler and send its reply, or the ErrorReply (500) of what it raised. True when the
        request was handed to the handler thread, which answers it and ends it (``_count_busy``).

        A plain handler's reply leaves from the handler thread itself, as far as the socket takes it at once:
        the client need not wait for the event loop to wake up for it (on 2 cores, a turn of the loop and a
        hand-over of the GIL). Nor is the loop woken when the thread is done: it learns that when the next
        request's header arrives (``_InFlight.answered``). Only when the socket did not take the whole reply
        is the loop woken at once, to send the rest."""
        if inspect.iscoroutinefunction(handler):  # on the event loop, concurrently with others
            try:
                parts = self._reply(method, 200, await handler(msg))
            except Exception as e:
                parts = self._failure(method, e)
            await conn.send(parts)
            return False
        rest = self._loop.create_future()  # set once the part of the reply the socket did not take is sent
        flight.call, flight.rest = self._worker.submit(self._run_and_reply, conn, method, handler, msg, rest), rest
        return True  # submitted now, in the order requests were decoded

    def _init_handler_thread(self) -> None:
        if self.thread_init is not None:
            try:
                self.thread_init()
            except BaseException as e:  # reported to every call rather than killing the thread silently
                self._init_error = e

    def _run_and_reply(self, conn: Connection, method: str, handler: Handler, msg: Any, rest: asyncio.Future) -> bool:
        """On the handler thread: the handler, its reply encoded and sent as far as it goes. True when the
        rest goes from the event loop (``rest`` is set once it has left)."""
        try:
            try:
                if self._init_error is not None:
                    raise RuntimeError(f"the handler thread's init failed: {self._init_error!r}") from self._init_error
                parts = self._reply(method, 200, handler(msg))
            except Exception as e:
                parts = self._failure(method, e)
            unsent = conn.send_nowait(parts)
        except BaseException:  # a bug here: nobody on the loop waits for this call, so end the connection
            log.exception("RPC server of rank %d failed to answer %s from %s", self.rank, method, conn.peer)
            self._loop.call_soon_threadsafe(conn.close)
            raise
        if not unsent:
            self._count_busy(-1)
            return False
        self._loop.call_soon_threadsafe(self._send_rest, conn, unsent, rest)
        return True

    def _send_rest(self, conn: Connection, unsent: list[memoryview], rest: asyncio.Future) -> None:
        """On the event loop: what the handler thread could not send."""
        task = asyncio.ensure_future(conn.send(unsent))
        self._tasks.add(task)  # cancelled with the connections when the server stops

        def sent(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            self._count_busy(-1)
            if not rest.done():  # an error is the result, raised by whoever waits: never an unretrieved one
                rest.set_result(ConnectionEnded("cancelled") if task.cancelled() else task.exception())

        task.add_done_callback(sent)

    def _reply(self, method: str, status: int, reply: Any) -> list[Buffer]:
        try:
            return reply_parts(status, encode_parts(reply))
        except Exception as e:  # not a message (EncodeError): the handler's bug, told to the caller
            return self._failure(method, e)

    def _failure(self, method: str, e: Exception) -> list[Buffer]:
        log.exception("handler for %s failed", method)
        text = "".join(traceback.format_exception(e))
        return reply_parts(500, encode_parts(ErrorReply(self.rank, method, type(e).__name__, str(e), text)))

    async def _send(self, conn: Connection, status: int, reply: Any) -> None:
        await conn.send(reply_parts(status, encode_parts(reply)))

    async def _refuse(self, conn: Connection, refusal: _Refused) -> None:
        reply = ErrorReply(self.rank, refusal.method, refusal.error_type, refusal.message, "")
        with contextlib.suppress(ConnectionError):
            await self._send(conn, refusal.status, reply)
            await conn.close_after_reply(LINGER_S)


class _InFlight:
    """A connection's request whose plain handler was handed to the handler thread, until its reply has left."""

    def __init__(self) -> None:
        self.call: Call | None = None
        self.rest: asyncio.Future | None = None

    async def answered(self) -> None:
        """Wait until the handler has run and its whole reply was sent; raises why the reply could not go."""
        call, rest = self.call, self.rest
        if call is None or rest is None:
            return
        self.call = self.rest = None
        if await call.result():  # the loop sends the rest of the reply
            error = await rest
            if error is not None:
                raise error

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()


def _acknowledge(_: Any) -> Ack:
    return Ack()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if is_ipv6(host) or host == "::" else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=512)
    sock.setblocking(False)
    return sock


def _request_type(handler: Handler) -> type | None:
    """The registered message class a handler's first parameter is annotated with, if any."""
    try:
        params = list(inspect.signature(handler).parameters.values())
        ann = typing.get_type_hints(handler).get(params[0].name) if params else None
    except Exception:  # unannotated callables, lambdas, builtins: accept any message
        return None
    return ann if isinstance(ann, type) and MESSAGES.get(ann.__name__) is ann else None
