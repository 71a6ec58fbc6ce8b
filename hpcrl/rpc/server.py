"""One RPC endpoint per worker rank: ``POST /rpc/<method>`` on aiohttp; plain handlers run one at a time.

Order of checks on a request, each answered with an ErrorReply frame before anything later happens::

    token (Authorization: Bearer)  -> 401   on every path and HTTP method, before any route is looked up:
                                            nothing of the body is read, the handler does not run, and
                                            nothing tells which paths or methods exist
    method known                   -> 404   the reply lists the known methods
    Content-Length present, small  -> 411 / 413
    body decodes (wire.decode)     -> 400   the DecodeError message
    handler(msg) -> reply          -> 500   ErrorReply(rank, method, type, message, traceback)

The first three run in the ``Expect: 100-continue`` hook too, so a client that asks (``RpcClient``
does for bodies of 64 KiB and more) sends no body at all to a server that would refuse it. A refused
body that was sent anyway is never read by hpcrl; aiohttp discards it before closing the connection.

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
import traceback
import typing
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, web

from hpcrl.net import discover_host, family_of, format_hostport, is_ipv6
from hpcrl.rpc import auth
from hpcrl.rpc.handler_thread import HandlerThread
from hpcrl.rpc.messages import MESSAGES, Ack, ErrorReply
from hpcrl.rpc.transport import CONTENT_TYPE, METHOD_NAME, ROUTE, SHUTDOWN, bearer, frame_size, read_body, write_parts
from hpcrl.rpc.wire import DecodeError, decode, encode, encode_parts

log = logging.getLogger(__name__)
Handler = Callable[[Any], Any]
_WILDCARDS = ("", "0.0.0.0", "::")
READ_BUFSIZE = 4 << 20  # the default 64 KiB pauses the socket after every recv of a large body


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
    ):
        bad = [m for m in handlers if not METHOD_NAME.match(m)]
        if bad:
            raise ValueError(f"RPC method names must match {METHOD_NAME.pattern}, got {bad}")
        if not token:
            raise ValueError("token must not be empty; read it with hpcrl.rpc.auth.read_token(run_dir)")
        self.handlers, self.token, self.rank = dict(handlers), token, rank
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.advertise_host, self.thread_init, self.shutdown_timeout_s = advertise_host, thread_init, shutdown_timeout_s
        self.address: str | None = None  # host:port peers dial, set once listening
        self._request_types = {m: _request_type(h) for m, h in self.handlers.items()}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._worker: HandlerThread | None = None

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
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._authenticate])
        app.router.add_post(ROUTE, self._handle, expect_handler=self._expect)
        # every other path and method: the token first here too, even for "Expect: 100-continue" (aiohttp's own
        # 404 would answer 100 Continue first, telling a stranger which paths are routes)
        app.router.add_route("*", "/{tail:.*}", self._no_route, expect_handler=self._expect_no_route)
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=self.shutdown_timeout_s, read_bufsize=READ_BUFSIZE
        )
        await runner.setup()
        self._worker = HandlerThread(f"rpc-handler-{self.rank}", self.thread_init)
        try:
            sock = _listen(self.host, self.port)
            await web.SockSite(runner, sock).start()
            self._loop, self._stop_event = asyncio.get_running_loop(), asyncio.Event()
            self.address = format_hostport(self._advertised_host(), sock.getsockname()[1])
            log.info("RPC server of rank %d listening on %s (bound %s)", self.rank, self.address, self.host)
            on_ready(self.address)
            if not self._stop_requested:
                await self._stop_event.wait()
        finally:
            await runner.cleanup()
            self._worker.stop()
            log.info("RPC server of rank %d stopped", self.rank)

    def _advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return discover_host(family_of(self.host or "0.0.0.0")) if self.host in _WILDCARDS else self.host

    # --- requests ---------------------------------------------------------------------------------------

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """The token before anything else: a request without it learns nothing of the routes (a 404 or 405
        would say which paths and methods exist)."""
        if not self._authorized(request):
            return self._unauthorized(request)
        return await handler(request)

    def _authorized(self, request: web.Request) -> bool:
        return auth.check(bearer(request.headers.get(hdrs.AUTHORIZATION)), self.token)

    def _unauthorized(self, request: web.Request) -> web.Response:
        """The same reply for every path and method, so that it tells nothing of what the server has."""
        log.warning("refused %s %s from %s: missing or wrong token", request.method, request.path, request.remote)
        message = "missing or wrong token; send the run's <run_dir>/secret as 'Authorization: Bearer <token>'"
        return self._refusal(401, "", "AuthError", message)

    def _precheck(self, request: web.Request) -> web.Response | None:
        """Refuse on the headers alone: token, method, body size. None when the body may be read."""
        method = request.match_info["method"]
        if not self._authorized(request):
            return self._unauthorized(request)
        if method not in self.handlers and method != SHUTDOWN:
            known = sorted([*self.handlers, SHUTDOWN])
            return self._refusal(404, method, "UnknownMethod", f"no RPC method {method!r}; this server has {known}")
        length = request.content_length
        if length is None:
            return self._refusal(411, method, "LengthRequired", "the request must carry a Content-Length")
        if length > self.max_body_bytes:
            message = f"body of {length} bytes is over this server's limit of {self.max_body_bytes} (max_body_bytes)"
            return self._refusal(413, method, "PayloadTooLarge", message)
        return None

    async def _no_route(self, request: web.Request) -> web.Response:
        known = f"POST {ROUTE} with a method of {sorted([*self.handlers, SHUTDOWN])}"
        return self._refusal(404, "", "NotFound", f"no {request.method} {request.path}; this server takes {known}")

    async def _expect_no_route(self, request: web.Request) -> web.Response:
        return self._unauthorized(request) if not self._authorized(request) else await self._no_route(request)

    async def _expect(self, request: web.Request) -> web.Response | None:
        refused = self._precheck(request)
        if refused is not None:
            return refused
        if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
            return self._refusal(417, request.match_info["method"], "ExpectationFailed", "only 100-continue")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim response is not part of the reply's size
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._handle_checked(request)
        except Exception as e:  # a bug here, not in a handler: still answer with a typed error
            log.exception("RPC server of rank %d failed on %s", self.rank, request.path)
            text = "".join(traceback.format_exception(e))
            reply = ErrorReply(self.rank, request.match_info["method"], type(e).__name__, str(e), text)
            return await self._send(request, (500, encode_parts(reply)), close=True)

    async def _handle_checked(self, request: web.Request) -> web.StreamResponse:
        refused = self._precheck(request)
        if refused is not None:
            return refused
        method = request.match_info["method"]
        try:
            body = await read_body(request.content, request.content_length or 0)
        except Exception as e:  # the client went away mid-body; there is no one to answer
            log.warning("%s from %s: could not read the body: %r", method, request.remote, e)
            return self._refusal(400, method, "BodyError", f"could not read the body: {e}")
        try:
            msg = decode(body, self._request_types.get(method))
        except DecodeError as e:
            return self._refusal(400, method, "DecodeError", str(e))
        if method == SHUTDOWN:
            return await self._shutdown(request, msg)
        reply = await self._run(method, self.handlers[method], msg)
        return await self._send(request, reply)

    async def _run(self, method: str, handler: Handler, msg: Any) -> tuple[int, list]:
        assert self._worker is not None
        try:
            if inspect.iscoroutinefunction(handler):  # on the event loop, concurrently with others
                reply = await handler(msg)
            else:
                reply = await asyncio.wrap_future(self._worker.submit(handler, msg))
            return 200, encode_parts(reply)
        except Exception as e:
            log.exception("handler for %s failed", method)
            text = "".join(traceback.format_exception(e))
            return 500, encode_parts(ErrorReply(self.rank, method, type(e).__name__, str(e), text))

    async def _shutdown(self, request: web.Request, msg: Any) -> web.StreamResponse:
        handler = self.handlers.get(SHUTDOWN, lambda _: Ack())
        reply = await self._run(SHUTDOWN, handler, msg)
        log.info("shutdown requested by %s", request.remote)
        response = await self._send(request, reply, close=True)
        self.stop()
        return response

    async def _send(self, request: web.Request, reply: tuple[int, list], close: bool = False) -> web.StreamResponse:
        status, parts = reply
        response = web.StreamResponse(status=status)
        response.content_type, response.content_length = CONTENT_TYPE, frame_size(parts)
        if close:
            response.force_close()
        try:
            await response.prepare(request)
            await write_parts(response, parts)
            await response.write_eof()
        except ConnectionError as e:
            log.warning("could not send the reply to %s: %r", request.remote, e)
        return response

    def _refusal(self, status: int, method: str, error_type: str, message: str) -> web.Response:
        body = encode(ErrorReply(self.rank, method, error_type, message, ""))
        response = web.Response(status=status, body=body, content_type=CONTENT_TYPE)
        response.force_close()  # an unread (or never sent) body must not be taken for the next request
        return response


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if is_ipv6(host) or host == "::" else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=512)


def _request_type(handler: Handler) -> type | None:
    """The registered message class a handler's first parameter is annotated with, if any."""
    try:
        params = list(inspect.signature(handler).parameters.values())
        ann = typing.get_type_hints(handler).get(params[0].name) if params else None
    except Exception:  # unannotated callables, lambdas, builtins: accept any message
        return None
    return ann if isinstance(ann, type) and MESSAGES.get(ann.__name__) is ann else None
