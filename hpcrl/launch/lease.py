"""Leases: no worker outlives its controller, and the controller learns when a worker can no longer be reached.

One heartbeat does both, over a small HTTP endpoint of each worker's own (``POST /lease``, the run's secret
as a bearer token checked before anything else, JSON bodies; no torch, so that workers that only speak HTTP
start fast)::

    controller: LeaseKeeper, a thread of its own (a busy event loop or a long step cannot starve it)
        every lease_s / 6: {"controller": id} to every worker that has registered (its entry's extra["lease"]),
        each with a deadline
        a worker unanswered for lease_s -> on_lost(entry, why): its group marks it lost (``WorkerGroup.mark_lost``),
        so the watchdog's check_alive treats it as ended, naming its role, rank, node and address
    worker: Lease, with a watcher thread, and its endpoint (serve(): a thread of its own, so it answers
        even while the worker's own work blocks); a renewal from another controller (say, a rerun that
        resumes the run) does not count
        no renewal for lease_s -> on_expire(why), by default SIGTERM to itself: the worker's own shutdown path
        ends its children by PID and unregisters; a worker still there EXIT_GRACE_S later exits at once

Why a heartbeat over the network rather than a parent-death signal or a file: on Slurm the workers are
not the controller's children, and a node cut off from the network still sees a file on this machine's
test cluster (one filesystem) but hears no heartbeat; the heartbeat is also how the controller sees that
cut. Before its first renewal a worker gets its role's setup timeout on top (``grace_s``): the controller
renews a worker only once it has registered, which is when its setup is done. That grace ends when the worker
serves its endpoint to register it: from then on it waits for a first renewal at most ``REGISTRY_SEEN_S`` (or a
lease, if longer) for the controller to find the entry, plus the lease itself, so a controller that dies between
a worker's registration and its first renewal does not leave the worker holding its node for the rest of the
setup timeout. And it ends at the worker's first contact with the controller (``contact``): its first renewal,
or an authenticated call, whichever comes first; from then on a lease without a renewal ends the worker. A
controller that reached a worker over RPC has found its entry, and renews it within ``lease_s`` / 6, so the
wait for the registry is over: a controller killed right after its first step (its workers called, not yet
renewed) left them running for the registry's delay plus the lease, 90 s by default. The trainer ranks and
rollout workers count every RPC connection that presents the run's token (``RpcServer``'s
``on_authenticated``); a server worker only the renewal: the controller calls its server's HTTP API, which
takes no token and is another process.

Every scheduler hands a worker its lease in the environment (``HPCRL_CONTROLLER_ID``, ``HPCRL_LEASE_S``,
``HPCRL_LEASE_GRACE_S``; ``worker_env``); ``Lease.from_env`` reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import aiohttp
from aiohttp import web

from hpcrl.launch.base import RoleSpec
from hpcrl.launch.registry import Entry, Registry
from hpcrl.net import format_hostport, is_ipv6
from hpcrl.rpc.auth import check

log = logging.getLogger(__name__)

CONTROLLER_ID_ENV = "HPCRL_CONTROLLER_ID"  # the controller the worker belongs to: a fresh id per controller start
LEASE_S_ENV = "HPCRL_LEASE_S"  # how long the worker lives without a renewal
LEASE_GRACE_S_ENV = "HPCRL_LEASE_GRACE_S"  # more time before the first one: the worker's setup
LEASE_EXPIRED_EXIT = 75  # a worker's exit code when its lease ran out and SIGTERM did not end it (EX_TEMPFAIL)
EXIT_GRACE_S = 30.0  # how long a worker whose lease ran out gets to end its children after its own SIGTERM
ROUTE = "/lease"
# how long a new registry entry may take to be seen from the controller's node: the keeper reads the registry every
# lease_s / 6, but an NFS client caches a directory's listing for up to acdirmax (60 s by default on Linux)
REGISTRY_SEEN_S = 60.0


def lease_env(controller: str, lease_s: float, grace_s: float) -> dict[str, str]:
    """What a worker needs in its environment to hold a lease on ``controller`` (``Lease.from_env``)."""
    return {CONTROLLER_ID_ENV: controller, LEASE_S_ENV: f"{lease_s:g}", LEASE_GRACE_S_ENV: f"{grace_s:g}"}


def with_lease(spec: RoleSpec, controller: str, lease_s: float) -> RoleSpec:
    """``spec`` whose workers hold a lease on ``controller``, with their setup timeout before the first renewal."""
    return replace(spec, env={**spec.env, **lease_env(controller, lease_s, spec.setup_timeout_s)})


def end_this_process(why: str) -> None:
    """The default ``on_expire``: SIGTERM to this process, so that its own shutdown path (the one a scheduler's
    stop takes) ends its children by PID; if it is still running ``EXIT_GRACE_S`` later, exit at once."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_GRACE_S)
    log.error("still running %g s after its own SIGTERM (%s): exiting at once", EXIT_GRACE_S, why)
    os._exit(LEASE_EXPIRED_EXIT)


def unanswered(entry: Entry, silent_s: float, error: str) -> str:
    """Why a worker counts as lost, for its ``WorkerFailed``."""
    return (
        f"on node {entry.node} ({entry.address}) has not answered the controller for {silent_s:.0f} s "
        f"(cluster.worker_lease_s): {error}; its node may be down or cut off from the network"
    )


class Lease:
    """The worker's side: alive while renewals from its own controller keep coming."""

    def __init__(
        self,
        controller: str,
        lease_s: float,
        on_expire: Callable[[str], None],
        grace_s: float = 0.0,
        poll_s: float | None = None,
        registry_seen_s: float = REGISTRY_SEEN_S,
    ):
        if lease_s <= 0:
            raise ValueError(f"a lease must last > 0 s, got {lease_s}")
        self.controller, self.lease_s, self.on_expire = controller, lease_s, on_expire
        self.poll_s = poll_s if poll_s is not None else min(1.0, lease_s / 10)
        self.deadline = time.monotonic() + lease_s + grace_s
        self.registry_seen_s = registry_seen_s
        self.renewals = 0
        self.contacted = False  # the controller has reached this worker: the grace is over
        self._lock = threading.Lock()  # the deadline is moved from the endpoint's thread and the RPC server's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: threading.Thread | None = None

    @classmethod
    def from_env(
        cls, on_expire: Callable[[str], None] = end_this_process, environ: Mapping[str, str] | None = None
    ) -> Lease | None:
        """The lease a scheduler set in the environment, started; None for a worker started by hand (no lease)."""
        env = os.environ if environ is None else environ
        if CONTROLLER_ID_ENV not in env:
            return None
        grace = float(env.get(LEASE_GRACE_S_ENV, "0"))
        return cls(env[CONTROLLER_ID_ENV], float(env[LEASE_S_ENV]), on_expire, grace_s=grace).start()

    def renew(self, controller: str) -> bool:
        """A heartbeat from ``controller``; only this worker's own counts."""
        if controller != self.controller:
            return False
        with self._lock:
            self.deadline = time.monotonic() + self.lease_s
            self.renewals += 1
        self.contact()
        return True

    def contact(self) -> None:
        """The controller has reached this worker (a renewal, or an RPC connection with the run's token): what
        is left of the setup grace goes, and a lease from now on ends the worker unless a renewal comes. Never
        moves the deadline later. Any thread."""
        with self._lock:
            self.deadline = min(self.deadline, time.monotonic() + self.lease_s)
            first, self.contacted = not self.contacted, True
        if first:
            log.info(
                "first contact with controller %s: from now on %g s without a renewal end this worker",
                self.controller,
                self.lease_s,
            )

    def serve(self, token: str, host: str, port: int, advertise_host: str) -> str:
        """Take heartbeats at ``POST /lease`` on a thread of its own; the address to register (extra["lease"]).
        The worker's setup is over: the rest of the setup grace goes (module doc)."""
        first_renewal = max(self.lease_s, self.registry_seen_s) + self.lease_s
        with self._lock:
            self.deadline = min(self.deadline, time.monotonic() + first_renewal)
        ready: list[str] = []
        started = threading.Event()
        self._server = threading.Thread(
            target=lambda: asyncio.run(self._serve(token, host, port, advertise_host, ready, started)),
            name="lease-endpoint",
            daemon=True,
        )
        self._server.start()
        if not started.wait(30) or not ready:
            raise RuntimeError(f"the lease endpoint could not listen on {format_hostport(host or '0.0.0.0', port)}")
        return ready[0]

    async def _serve(
        self, token: str, host: str, port: int, advertise: str, ready: list[str], started: threading.Event
    ) -> None:
        @web.middleware
        async def authenticate(request: web.Request, handler: Callable) -> web.StreamResponse:
            if not check(_bearer(request), token):  # before any route is looked up: every path gets the same 401
                return web.json_response({"error": "missing or wrong token"}, status=401)
            return await handler(request)

        async def renew(request: web.Request) -> web.Response:
            try:
                controller = str((await request.json())["controller"])
            except (ValueError, KeyError, TypeError):
                return web.json_response({"error": 'expected {"controller": "<id>"}'}, status=400)
            return web.json_response({"ok": self.renew(controller), "controller": self.controller})

        async def expect(request: web.Request) -> web.Response | None:
            if not check(_bearer(request), token):  # no "100 Continue" to a stranger, whatever the path
                return web.json_response({"error": "missing or wrong token"}, status=401)
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return None

        async def no_route(request: web.Request) -> web.Response:
            return web.json_response({"error": f"no {request.method} {request.path}; POST {ROUTE}"}, status=404)

        app = web.Application(client_max_size=4096, middlewares=[authenticate])
        app.router.add_post(ROUTE, renew, expect_handler=expect)
        app.router.add_route("*", "/{tail:.*}", no_route, expect_handler=expect)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            family = socket.AF_INET6 if is_ipv6(host) or host == "::" else socket.AF_INET
            sock = socket.create_server((host, port), family=family)
            await web.SockSite(runner, sock).start()
            ready.append(format_hostport(advertise, sock.getsockname()[1]))
        finally:
            started.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.2)
        await runner.cleanup()

    def start(self) -> Lease:
        self._thread = threading.Thread(target=self._watch, name="lease", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            late = time.monotonic() - self.deadline
            if late > 0:
                why = (
                    f"no word from controller {self.controller} for {self.lease_s + late:.0f} s "
                    f"({self.renewals} renewals so far): it is gone, so this worker ends"
                )
                log.error("%s", why)
                self.on_expire(why)
                return


class LeaseKeeper:
    """The controller's side: renews every registered worker's lease from a thread of its own, and calls
    ``on_lost(entry, why)`` (from that thread) once for a worker unanswered for a whole lease."""

    def __init__(
        self,
        registry: Registry,
        roles: list[str],
        controller: str,
        token: str,
        lease_s: float,
        on_lost: Callable[[Entry, str], None],
    ):
        self.registry, self.roles, self.controller, self.token = registry, roles, controller, token
        self.lease_s, self.interval_s, self.on_lost = lease_s, lease_s / 6, on_lost
        self.answered: dict[tuple[str, int, int, str], float] = {}  # (role, rank, pid, lease address) -> last answer
        self.errors: dict[tuple[str, int, int, str], str] = {}
        self.lost: set[tuple[str, int, int, str]] = set()  # reported to on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None  # stop() wakes the wait with it

    def start(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._wake is not None:  # else the thread has not started waiting: it sees _stop before it does
            loop, wake = self._wake
            with contextlib.suppress(RuntimeError):  # its loop is closed: the thread is done
                loop.call_soon_threadsafe(wake.set)
        if self._thread is not None:
            self._thread.join(self.interval_s + 15)

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.run(self._renew_until_stopped())

    async def _renew_until_stopped(self) -> None:
        wake = asyncio.Event()
        self._wake = (asyncio.get_running_loop(), wake)
        while not self._stop.is_set():
            started = time.monotonic()
            entries = [e for role in self.roles for e in self.registry.entries(role)]
            if entries:
                await self._renew(entries)
            # until the next renewal, or at once when stop() is called: a controller that is done does not wait
            # out the interval (lease_s / 6, 5 s by default) before the scheduler stops its workers
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), max(0.0, self.interval_s - (time.monotonic() - started)))

    async def _renew(self, entries: list[Entry]) -> None:
        timeout = aiohttp.ClientTimeout(total=min(10.0, self.lease_s / 3))
        headers = {"Authorization": f"Bearer {self.token}"}
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            results = await asyncio.gather(*(self._one(session, e) for e in entries), return_exceptions=True)
        now = time.monotonic()
        for entry, result in zip(entries, results, strict=True):
            key = (entry.role, entry.rank, entry.pid, entry.extra.get("lease", entry.address))
            first_seen = self.answered.setdefault(key, now)  # a new entry's clock starts when it is first seen
            if result is True:
                self.answered[key] = now
                continue
            self.errors[key] = f"{type(result).__name__}: {result}" if isinstance(result, BaseException) else result
            silent_s = now - self.answered.get(key, first_seen)
            if silent_s > self.lease_s and key not in self.lost and self._still_registered(entry):
                self.lost.add(key)
                why = unanswered(entry, silent_s, self.errors[key])
                log.error("%s worker %d %s", entry.role, entry.rank, why)
                self.on_lost(entry, why)

    async def _one(self, session: aiohttp.ClientSession, entry: Entry) -> bool | str:
        """True once the worker took the heartbeat; else what it said."""
        address = entry.extra.get("lease")
        if not address:
            return "it registered no lease endpoint"
        async with session.post(f"http://{address}{ROUTE}", json={"controller": self.controller}) as response:
            said = await response.json(content_type=None)
        if response.status == 200 and said.get("ok"):
            return True
        return f"HTTP {response.status}: {said}"

    def _still_registered(self, entry: Entry) -> bool:
        """A worker the controller has let go (a dead server dropped or restarted) is no longer in the registry."""
        return any(e.rank == entry.rank and e.pid == entry.pid for e in self.registry.entries(entry.role))


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    return header[len("Bearer ") :].strip() if header.startswith("Bearer ") else None
