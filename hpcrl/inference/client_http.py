"""The wire under the inference client: HTTP calls with deadlines, bounded retries, and per-server load.

One call is ``(method, endpoint, payload)`` sent to a server that a ``choose`` callback names before each
attempt, so a generate request can move to another server when its first one fails.

What is retried, with exponential backoff (``backoff_s * 2**k``, capped at ``MAX_BACKOFF_S``, jittered so
hundreds of requests failing together do not return in lockstep):

- connection failures: refused, reset, DNS, a connect that timed out, a body cut off mid-way;
- HTTP 5xx (SGLang answers 503 while it cannot take work, 500 when a request failed inside it).

One more send, once per call and whatever ``retries`` says, on a fresh connection: when a pooled keep-alive
connection turns out closed under the request (``ServerDisconnectedError``, a reset). uvicorn, SGLang's
HTTP server, closes idle connections after 5 s, and a POST that meets the close was never read by the
server; aiohttp resends only idempotent methods itself. A weight-update call, never retried otherwise
(a server that joins a collective twice waits for a partner that is not coming), is safe to send again
then.

A server that leaves the pool (``leave``: it died, or its node went silent) ends the attempts in flight on it at
once, as retryable failures: a generate request goes on on another server instead of waiting out its deadline on
a node that will never answer; a call that must reach that server (a weight update) fails, and its caller goes on
without the server.

What is not retried: HTTP 4xx (the request itself is wrong; the server's error body is in the message), a
request that got no answer within its deadline (it already cost a whole deadline, and the server may still
be working on it), and a malformed answer. Each attempt has a deadline (``aiohttp.ClientTimeout``), so a
call ends within ``attempts * timeout + backoff`` seconds whatever the servers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
from yarl import URL

from hpcrl.net import parse_hostport

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # opening a TCP connection; a dead node should not hold a request for its full deadline
MAX_BACKOFF_S = 30.0  # the longest pause between two attempts
_BODY_CHARS = 2000  # how much of an error body goes into a message
# aiohttp >= 3.10 tells a connect timeout (retried) from a deadline (not retried); older ones do not.
_CONNECT_TIMEOUT: type[BaseException] | tuple[()] = getattr(aiohttp, "ConnectionTimeoutError", ())
_BROKEN_CONNECTION = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


class InferenceError(Exception):
    """An inference server failed, refused a request, or did not answer in time.

    ``server`` is the address (``host:port``) of the server at fault, ``endpoint`` the path called
    (empty for multi-step waits such as health checks), ``status`` the HTTP status if one came back.
    """

    def __init__(self, message: str, *, server: str, endpoint: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.server = server
        self.endpoint = endpoint
        self.status = status


class _Retryable(Exception):
    """An attempt failed in a way another attempt may fix."""


class _Left(_Retryable):
    """The server left the pool while the attempt ran: another server may answer at once, the same one never."""


class _Stale(_Retryable):
    """The connection was closed under the request before an answer: the server never read it."""


class HttpPool:
    """One aiohttp session over a set of servers (``add`` one more), with retries and in-flight counts per server."""

    def __init__(
        self, addresses: Sequence[str], *, timeout_s: float, max_retries: int, backoff_s: float, max_connections: int
    ) -> None:
        self.urls = {address: _base_url(address) for address in addresses}
        self.in_flight = dict.fromkeys(addresses, 0)  # requests now sent and not yet answered, per server
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._left: dict[str, asyncio.Event] = {}  # server -> set once it has left the pool (until it is added again)

    def add(self, address: str) -> None:
        """Know one more server (a restarted one, perhaps at a new address); a known one keeps its count."""
        self.urls.setdefault(address, _base_url(address))
        self.in_flight.setdefault(address, 0)
        self._left.pop(address, None)

    def leave(self, address: str) -> None:
        """``address`` has left the pool: the attempts in flight on it end now, as failures another server may fix."""
        self._left.setdefault(address, asyncio.Event()).set()

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
        # trust_env=False: cluster nodes often export HTTP(S)_PROXY for the internet, never for peers.
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("InferenceClient is not open; use it as `async with InferenceClient(...) as client:`")
        return self._session

    async def call(
        self,
        choose: Callable[[list[str]], Awaitable[str]],
        method: str,
        endpoint: str,
        payload: Any = None,
        *,
        retries: int | None = None,
        timeout_s: float | None = None,
        count: int = 0,
        expect_json: bool = True,
    ) -> tuple[str, Any]:
        """Send until one attempt succeeds; return ``(server, answer)``.

        ``await choose(tried)`` names the server of each attempt, given those that already failed (it may wait
        for a server to join an empty pool); ``count`` is added to that server's in-flight count while the
        attempt runs.
        """
        attempts = 1 + (self.max_retries if retries is None else retries)
        tried: list[str] = []
        attempt, fresh = 0, False
        while True:
            server = await choose(tried)
            self.in_flight[server] += count
            try:
                send = self._send(server, method, endpoint, payload, timeout_s, expect_json, fresh)
                return server, await self._unless_left(server, send)
            except _Stale as error:
                failure: _Retryable = error
                if not fresh:  # once per call, not counted: see the module's docstring
                    fresh = True
                    logger.info(
                        "%s %s on %s: %s; sending it again on a new connection", method, endpoint, server, error
                    )
                    continue
            except _Retryable as error:
                failure = error
            finally:
                self.in_flight[server] -= count
            attempt += 1
            tried.append(server)
            if attempt == attempts:
                raise InferenceError(
                    f"{method} {endpoint} failed after {attempts} attempt(s) on {', '.join(tried)}; last error "
                    f"from {server}: {failure}. Check that the server is up (its log, its job) and reachable "
                    "from this node",
                    server=server,
                    endpoint=endpoint,
                ) from failure
            delay = min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S) * random.uniform(0.5, 1.0)
            delay *= not isinstance(failure, _Left)  # nothing to wait for: the pool no longer holds that server
            logger.warning(
                "%s %s on %s failed (attempt %d of %d): %s; retrying in %.2f s",
                *(method, endpoint, server, attempt, attempts, failure, delay),
            )
            await asyncio.sleep(delay)

    async def call_all(
        self,
        method: str,
        endpoint: str,
        payloads: Mapping[str, Any],
        *,
        retries: int | None = None,
        timeout_s: float | None = None,
        check: Callable[[str, str, Any], None] | None = None,
        expect_json: bool = True,
    ) -> dict[str, Any]:
        """Call every server in ``payloads`` concurrently; the first failure cancels the rest and is raised."""
        if not payloads:  # an empty pool (its one server is restarting): nothing to call
            return {}

        async def one(server: str) -> Any:
            _, answer = await self.call(
                fixed(server),
                method,
                endpoint,
                payloads[server],
                retries=retries,
                timeout_s=timeout_s,
                expect_json=expect_json,
            )
            if check is not None:
                check(server, endpoint, answer)
            return answer

        tasks = {server: asyncio.create_task(one(server)) for server in payloads}
        try:
            await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        finally:
            pending = [task for task in tasks.values() if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        failures = {s: e for s, t in tasks.items() if not t.cancelled() and (e := t.exception()) is not None}
        if failures:
            raise _combined(method, endpoint, failures, len(tasks))
        return {server: task.result() for server, task in tasks.items()}

    async def probe_health(self, server: str, timeout_s: float) -> str:
        """GET /health once; return "" if it answered 200, else what went wrong."""
        try:
            url = self.urls[server].with_path("/health")
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                await response.read()
                return "" if response.status == 200 else f"HTTP {response.status}"
        except TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except aiohttp.ClientError as error:
            return f"{type(error).__name__}: {error}"

    async def _unless_left(self, server: str, attempt: Awaitable[Any]) -> Any:
        """``attempt``'s answer, unless ``server`` leaves the pool first: then ``_Left``."""
        left = self._left.setdefault(server, asyncio.Event())
        request = asyncio.ensure_future(attempt)
        leaving = asyncio.ensure_future(left.wait())
        try:
            await asyncio.wait((request, leaving), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (request, leaving):
                task.cancel()
            await asyncio.gather(request, leaving, return_exceptions=True)
        if request.done() and not request.cancelled():
            return request.result()
        raise _Left(f"{server} left the pool (it died or went silent) before it answered")

    async def _send(
        self,
        server: str,
        method: str,
        endpoint: str,
        payload: Any,
        timeout_s: float | None,
        expect_json: bool,
        fresh: bool = False,
    ) -> Any:
        deadline = self.timeout_s if timeout_s is None else timeout_s
        timeout = aiohttp.ClientTimeout(total=deadline, sock_connect=min(CONNECT_TIMEOUT_S, deadline))
        url = self.urls[server].with_path(endpoint)
        try:
            async with contextlib.AsyncExitStack() as stack:
                session = self.session
                if fresh:  # a connection of its own, never one from the pool
                    connector = aiohttp.TCPConnector(force_close=True)
                    session = await stack.enter_async_context(
                        aiohttp.ClientSession(connector=connector, trust_env=False)
                    )
                async with session.request(method, url, json=payload, timeout=timeout) as response:
                    status, body = response.status, (await response.read()).decode(errors="replace")
        except _CONNECT_TIMEOUT as error:
            raise _Retryable(f"no connection within {min(CONNECT_TIMEOUT_S, deadline):g} s") from error
        except TimeoutError as error:
            raise InferenceError(
                f"{method} {endpoint} on {server} got no answer within the {deadline:g} s timeout (not retried); "
                "the server is hung or overloaded, or the work takes longer than the timeout allows: check the "
                "server's log, or raise the timeout (rollout.request_timeout_s; inference.weight_update_timeout_s for "
                "weight updates)",
                server=server,
                endpoint=endpoint,
            ) from error
        except aiohttp.ServerDisconnectedError as error:
            raise _Stale(f"{type(error).__name__}: {error}") from error
        except aiohttp.ClientOSError as error:  # a reset or a broken pipe on a pooled connection; not a refused connect
            kind = _Retryable if isinstance(error, aiohttp.ClientConnectorError) else _Stale
            raise kind(f"{type(error).__name__}: {error}") from error
        except _BROKEN_CONNECTION as error:
            raise _Retryable(f"{type(error).__name__}: {error}") from error
        if status >= 500:
            raise _Retryable(f"HTTP {status}: {body[:_BODY_CHARS]}")
        if status >= 400:
            raise InferenceError(
                f"{method} {endpoint} on {server} failed with HTTP {status} (a 4xx is not retried): {_reason(body)}",
                server=server,
                endpoint=endpoint,
                status=status,
            )
        if not expect_json:
            return body
        try:
            return json.loads(body)
        except json.JSONDecodeError as error:
            raise InferenceError(
                f"{method} {endpoint} on {server} answered HTTP {status} with a body that is not JSON: "
                f"{body[:_BODY_CHARS]!r}",
                server=server,
                endpoint=endpoint,
                status=status,
            ) from error


def fixed(server: str) -> Callable[[list[str]], Awaitable[str]]:
    """A ``choose`` for ``HttpPool.call`` that names ``server`` for every attempt."""

    async def choose(_tried: list[str]) -> str:
        return server

    return choose


def _base_url(address: str) -> URL:
    host, port = parse_hostport(address)  # raises ValueError naming the expected form
    return URL.build(scheme="http", host=host, port=port)


def _reason(body: str) -> str:
    """What a refusal says: SGLang's ``error_message`` when the body is a ``LoRAUpdateOutput`` (the LoRA routes
    answer 400 with one), else the body itself, cut to ``_BODY_CHARS``."""
    try:
        answer = json.loads(body)
    except json.JSONDecodeError:
        answer = None
    if isinstance(answer, dict) and answer.get("success") is False and isinstance(answer.get("error_message"), str):
        return answer["error_message"]
    return body[:_BODY_CHARS]


def _combined(method: str, endpoint: str, failures: Mapping[str, BaseException], total: int) -> BaseException:
    errors = list(failures.values())
    if len(errors) == 1 or not all(isinstance(e, InferenceError) for e in errors):
        return errors[0]
    server = next(iter(failures))
    return InferenceError(
        f"{method} {endpoint} failed on {len(errors)} of {total} servers: " + "; ".join(map(str, errors)),
        server=server,
        endpoint=endpoint,
    )
