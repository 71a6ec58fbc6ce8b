"""``python -m hpcrl.rollout.episode_worker [--run-dir DIR] [--rank N]``: one rollout worker (role ``rollout``).

It runs whole episodes for the controller, the workflow's requests and the reward, so that their CPU work
(tokenizing, workflow logic, reward processes) scales past the controller's one process::

    controller: RemoteEpisodes --run_episode(EpisodeRequest)--> rollout worker r: workflow --HTTP--> inference servers
                               <----------- Group ------------                    RewardPool (its own processes)

Start-up; a failure exits non-zero with the reason on stderr, which the scheduler writes to
``logs/rollout-<rank>.log`` and its ``WorkerFailed`` carries to the controller:

1. read the run's ``config.yaml`` and secret (``HPCRL_RUN_DIR`` or ``--run-dir``) and its rank (``HPCRL_RANK``
   or ``--rank``);
2. wait until the ``allocation.server.workers`` inference servers have registered (role ``server`` in the
   run's registry: a server registers once healthy), within the setup timeout: ``cluster.roles.rollout``'s,
   else the servers' own, since a rollout worker started beside the servers waits for them to load; and, with a
   reward model (``allocation.reward_model.workers`` > 0), for its servers too (role ``reward_model``);
3. load the tokenizer (``model.path``), start the reward pool (given the reward model's addresses), build the
   workflow (``make_workflow``), as the controller would, and check that every server answers /health;
4. serve RPC on a port of its own slot (``PortSlots`` role ``rollout``: ``HPCRL_PORT_SLOT_BASE`` + rank, so
   workers started at the same moment never pick the same port), then register ``host:port``: registered
   means ready. A plug-in workflow's per-episode OpenAI proxy (``hpcrl/rollout/proxy``) takes a port of the
   same slot, on the loopback address of the advertised family, when the first episode comes.

Threads: the main thread's event loop owns the inference client, the workflow and the ``resumed`` event.
The RPC server runs its own loop on a thread and hands every ``run_episode`` to the main loop, so any
number of episodes run at once (``RpcServer`` runs coroutine handlers concurrently on its loop, and plain
ones, such as ``ping``, one at a time on its handler thread).

RPC methods: ``run_episode(EpisodeRequest) -> Group``; ``set_resumed(SetResumed) -> Ack``, cleared by the
controller before a weight update aborts the servers' requests and set once the servers hold the new weights,
so samples the update aborted wait rather than resubmit; ``set_servers(SetServers) -> Ack``, which makes the inference
client's pool exactly those addresses when the controller restarted a server (perhaps at a new address) or
lost one: later requests go to these servers only, and with none they wait for one to join. A list with an
address that is not ``host:port``, or one twice, is refused as a whole (an RPC error naming it) and the pool
stays as it was; ``ping(Ping) -> Pong``; ``shutdown``. Messages: ``remote.py``.

It holds a lease on its controller (an endpoint of its own on another port, ``hpcrl/launch/lease.py``): with
no heartbeat for ``cluster.worker_lease_s`` it SIGTERMs itself (the setup grace before the first heartbeat ends
at the controller's first RPC connection).

Exit: the ``shutdown`` RPC (exit 0) or SIGTERM / SIGINT (exit 128 + the signal): unregister, stop serving
(requests in flight get the server's shutdown grace), cancel the episodes still running, close the
workflow (a plug-in's proxy) and the client, and end the reward processes by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.config.errors import ConfigError
from hpcrl.config.load import load_run_config
from hpcrl.config.schema import Config
from hpcrl.gc_freeze import freeze_startup_heap
from hpcrl.launch.addresses import port_range, worker_addresses
from hpcrl.launch.lease import Lease
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slots import parse_worker_args, worker_ports
from hpcrl.launch.stacks import watch_stack_requests
from hpcrl.logs import setup_logging
from hpcrl.rollout.remote import EpisodeRequest, SetResumed, SetServers
from hpcrl.rollout.workflows.base import Group, Workflow
from hpcrl.rpc.auth import read_token
from hpcrl.rpc.messages import Ack, Ping, Pong
from hpcrl.rpc.server import RpcServer
from hpcrl.rundir import RunDir

if TYPE_CHECKING:
    from hpcrl.inference.client import InferenceClient
    from hpcrl.net import PortAllocator

log = logging.getLogger("hpcrl.rollout.episode_worker")

ROLE = "rollout"
_POLL_S = 0.2  # how often the main loop checks for a signal or a stopped RPC server
_STOP_S = 15.0  # how long the RPC server gets to stop (its own shutdown grace is 5 s)


class _Stopped(Exception):
    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_worker_args("python -m hpcrl.rollout.episode_worker", __doc__.splitlines()[0], "rollout workers", argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = RunDir(Path(args.run_dir).absolute())
    setup_logging(ROLE, args.rank)  # stderr: the scheduler sends it to logs/rollout-<rank>.log
    lease = Lease.from_env()  # from the start: waiting for the servers counts against the lease's grace
    watch_stack_requests(run_dir.path, ROLE, args.rank)  # a hang report asks for every worker's stacks
    try:
        cfg = load_run_config(run_dir.config_file)
    except ConfigError as e:
        log.error("cannot read the run's config: %s", e)
        return 2
    logging.getLogger().setLevel(cfg.run.log_level)
    token = read_token(run_dir.path)
    try:
        servers = wait_for_servers(cfg, run_dir)
        reward_models = wait_for_servers(cfg, run_dir, "reward_model")
    except TimeoutError as e:
        log.error(
            "the inference servers did not register: %s (a rollout worker waits for them as long as "
            "cluster.roles.rollout.setup_timeout_s, else cluster.roles.server.setup_timeout_s)",
            e,
        )
        return 1
    from hpcrl.models.tokenizer import load_tokenizer
    from hpcrl.reward.pool import RewardPool

    tokenizer = load_tokenizer(cfg.model.path)
    with RewardPool.for_config(cfg.reward) as rewards:
        if reward_models:  # its reward functions score through the reward model's servers
            rewards.use_reward_model(reward_models)
        return asyncio.run(serve(cfg, run_dir, args.rank, token, servers, tokenizer, rewards, lease))


def setup_timeout(cfg: Config) -> float:
    """Seconds this worker gets to become ready: cluster.roles.rollout's, else the servers' (it waits for them)."""
    roles = cfg.cluster.roles
    return (roles.get(ROLE) or roles["server"]).setup_timeout_s


def wait_for_servers(cfg: Config, run_dir: RunDir, role: str = "server") -> list[str]:
    """The addresses of ``role``'s servers (the policy's, or the reward model's: none without workers), by rank,
    once every one has registered."""
    count, timeout_s = getattr(cfg.allocation, role).workers, setup_timeout(cfg)
    if not count:
        return []
    log.info("waiting up to %g s for %d %s workers to register in %s", timeout_s, count, role, run_dir.registry)
    entries = Registry(run_dir.registry).wait(role, count, timeout_s)
    return [e.address for e in entries]


async def serve(
    cfg: Config,
    run_dir: RunDir,
    rank: int,
    token: str,
    servers: list[str],
    tokenizer: Any,
    rewards: Any,
    lease: Lease | None = None,
) -> int:
    """Serve episodes until ``shutdown`` or a signal; returns the exit status."""
    from hpcrl.inference.client import InferenceClient
    from hpcrl.inference.options import client_options
    from hpcrl.rollout.proxy.server import loopback
    from hpcrl.rollout.workflows import close_workflow, make_workflow

    signals = _catch_signals()
    resumed = asyncio.Event()
    resumed.set()
    advertised, _ = worker_addresses(cfg.cluster.net)
    ports = worker_ports(port_range(cfg.cluster.net))  # this worker's slice: RPC, lease, a plug-in's proxy
    try:
        # the controller's settings: deadlines, the context check before sending, the servers' tp size
        async with InferenceClient(servers, **client_options(cfg)) as client:
            poll_s = cfg.inference.health_poll_s
            await client.wait_healthy(setup_timeout(cfg), check_alive=lambda: _check(signals), poll_s=poll_s)
            workflow = make_workflow(cfg, client, tokenizer, rewards, resumed, host=loopback(advertised), ports=ports)
            service = EpisodeService(workflow, client, resumed, asyncio.get_running_loop(), rank)
            service.lease = lease
            try:
                await _serve_registered(cfg, run_dir, rank, token, service, signals, ports)
            finally:
                await close_workflow(workflow)
            log.info("stopped after %d episodes", service.served)
    except _Stopped as e:
        log.info("%s while starting", e)
    return 128 + signals[0] if signals else 0


async def _serve_registered(
    cfg: Config,
    run_dir: RunDir,
    rank: int,
    token: str,
    service: EpisodeService,
    signals: list[int],
    ports: PortAllocator,
) -> None:
    advertised, bind = worker_addresses(cfg.cluster.net)
    port, lease_port = ports.allocate(2)
    lease = service.lease
    contact = lease.contact if lease else None  # the controller's first call ends the lease's setup grace
    server = RpcServer(
        service.handlers(), token, rank, host=bind, port=port, advertise_host=advertised, on_authenticated=contact
    )
    server.start_in_thread()
    extra = {"lease": lease.serve(token, bind, lease_port, advertised)} if lease else {}
    entry, registry = Entry(ROLE, rank, advertised, port, extra=extra), Registry(run_dir.registry)
    registered = registry.register(entry)
    log.info("ready: rollout RPC at %s (registered in %s)", server.address, registered)
    freeze_startup_heap("rollout")
    try:
        while not signals and not _stopped(server):
            await asyncio.sleep(_POLL_S)
    finally:
        registry.unregister_own(entry)  # an entry must not outlive the server it names
        server.stop()
        await _wait_stopped(server)
        await service.cancel_running()
    if signals:
        log.info("received %s", signal.Signals(signals[0]).name)
    with contextlib.suppress(TimeoutError):  # one that would not stop was logged by _wait_stopped
        server.serve_until_stopped(timeout_s=0)  # raises what stopped the server, if it failed


class EpisodeService:
    """The worker's RPC handlers; episodes, ``resumed`` and the inference ``client`` live on the main loop."""

    def __init__(
        self,
        workflow: Workflow,
        client: InferenceClient,  # the workflow's client: set_servers changes its pool
        resumed: asyncio.Event,
        loop: asyncio.AbstractEventLoop,
        rank: int,
    ):
        self.workflow, self.client, self.resumed, self.loop, self.rank = workflow, client, resumed, loop, rank
        self.lease: Lease | None = None  # the lease on the controller, when a scheduler gave one
        self.served = 0  # episodes that returned a group
        self._running: set[asyncio.Task] = set()

    def handlers(self) -> dict[str, Any]:
        return {
            "run_episode": self.run_episode,
            "set_resumed": self.set_resumed,
            "set_servers": self.set_servers,
            "ping": self.ping,
        }

    async def run_episode(self, request: EpisodeRequest) -> Group:
        return await self._on_main_loop(self._episode(request))

    async def set_resumed(self, request: SetResumed) -> Ack:
        await self._on_main_loop(self._set_resumed(request.resumed))
        return Ack()

    async def set_servers(self, request: SetServers) -> Ack:
        await self._on_main_loop(self._set_servers(request.addresses))
        return Ack()

    def ping(self, request: Ping) -> Pong:
        return Pong(self.rank, os.getpid())

    async def cancel_running(self) -> None:
        """Cancel the episodes still running (their callers are gone) and wait until they have ended."""
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    async def _on_main_loop(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def _episode(self, request: EpisodeRequest) -> Group:
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            group = await self.workflow.run(
                request.prompt, request.answer, seed=request.seed, columns=request.row_columns()
            )
        finally:
            self._running.discard(task)
        self.served += 1
        return group

    async def _set_resumed(self, resumed: bool) -> None:
        if resumed:
            self.resumed.set()
        else:
            self.resumed.clear()
        log.debug("generation %s", "resumed" if resumed else "paused")

    async def _set_servers(self, addresses: list[str]) -> None:
        """Make the client's pool ``addresses``, on the main loop: the client and its requests live there."""
        was = list(self.client.addresses)
        self.client.set_servers(addresses)
        log.info(
            "inference servers now: %s (were: %s)",
            ", ".join(addresses) or "none; requests wait for one to join",
            ", ".join(was) or "none",
        )


def _catch_signals() -> list[int]:
    """SIGTERM and SIGINT, recorded (in the order they came) for the main loop to act on between steps."""
    received: list[int] = []
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, received.append, signum)
    return received


def _check(signals: list[int]) -> None:
    if signals:
        raise _Stopped(signals[0])


def _stopped(server: RpcServer) -> bool:
    """Whether the RPC server has stopped: a ``shutdown`` request, ``stop()``, or a failure."""
    try:
        server.serve_until_stopped(timeout_s=0)
    except TimeoutError:
        return False
    except RuntimeError:  # it failed: raised again once the worker has cleaned up
        return True
    return True


async def _wait_stopped(server: RpcServer) -> None:
    deadline = time.monotonic() + _STOP_S
    while not _stopped(server):
        if time.monotonic() > deadline:
            log.warning("the RPC server at %s did not stop within %g s; exiting anyway", server.address, _STOP_S)
            return
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    raise SystemExit(main())
