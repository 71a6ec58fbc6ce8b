"""Episodes run by rollout workers (``episode_worker.py``), as the controller sees them.

    async with RemoteEpisodes(addresses, token) as remote:         # addresses[r]: rollout worker r's host:port
        group = await remote.run({"prompt": ..., "answer": ..., "columns": {...}})  # on the least-loaded live worker
        await remote.pause()    # before a weight update aborts the servers' requests ...
        await remote.resume()   # ... and once the servers hold the new weights
        await remote.set_servers(["node3:30000"])  # the inference servers' pool, after one restarted or died
        await remote.shutdown()

The wire (registered here, beside the client that sends it): ``run_episode(EpisodeRequest) -> Group``,
``set_resumed(SetResumed) -> Ack``, ``set_servers(SetServers) -> Ack``, ``ping(Ping) -> Pong`` and the built-in
``shutdown``. ``Group`` and ``Sample`` (``workflow.py``) are registered as RPC messages as they are, so a group
travels as typed JSON.

Dispatch: an episode goes to the live worker with the fewest episodes in flight from here, ties broken
round-robin. Each worker has two RPC clients: one for episodes (deadline ``episode_timeout_s``, a backstop),
one for control calls and heartbeats (deadline ``heartbeat_timeout_s``), so a ping never queues behind
episodes. An RPC connection carries one call at a time, so the episode client holds up to ``max_in_flight``
connections to its worker; more episodes wait here for a connection, within their deadline.

Failures: a worker is lost when a call to it ends without a reply (connection refused or reset, no reply
within the deadline) or when it misses a heartbeat (``ping`` every ``heartbeat_s``: catches a node that
vanished without closing its connections). Its episodes in flight then fail at once with
``RolloutWorkerLost`` ("rollout worker <rank> at <host:port> was lost ..."), and later episodes go to the
remaining workers; with none left, ``run`` raises ``NoRolloutWorkers``. An episode that raised on its
worker (the workflow failed) raises ``RolloutWorkerError`` with the remote traceback; that worker stays.
A control call sent to every worker (``pause``, ``resume``, ``set_servers``) loses a worker that gives no
reply, as above, and raises ``RolloutWorkerError`` for one that refused it (its handler raised).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from hpcrl.rollout.workflows.base import Group, Sample
from hpcrl.rpc.client import RpcClient
from hpcrl.rpc.errors import RemoteError, RpcConnectionError, RpcError
from hpcrl.rpc.messages import Ping, register

log = logging.getLogger(__name__)

register(Sample)
register(Group)


@register
@dataclasses.dataclass
class EpisodeRequest:
    prompt: str  # the prompt, templated as the dataset makes it
    answer: str  # the reference answer the reward compares with
    seed: int | None = None  # the episode's seed, which its requests' sampling seeds derive from; None: none
    columns: dict[str, str] = dataclasses.field(default_factory=dict)  # the row's columns the rewards take: JSON text

    @classmethod
    def of(cls, row: Mapping[str, Any], seed: int | None) -> EpisodeRequest:
        """The request for one episode of ``row``: its columns (any JSON value) each as JSON text on the wire."""
        columns = {name: json.dumps(value) for name, value in (row.get("columns") or {}).items()}
        return cls(row["prompt"], row["answer"], seed, columns)

    def row_columns(self) -> dict[str, Any]:
        """The row's columns as they were sent."""
        return {name: json.loads(text) for name, text in self.columns.items()}


@register
@dataclasses.dataclass
class SetResumed:
    resumed: bool  # False while weights are updated: samples an update aborted wait instead of resubmitting


@register
@dataclasses.dataclass
class SetServers:
    addresses: list[str]  # the inference servers' host:port, the whole pool: a restarted one joins, a dead one leaves


class RolloutWorkerError(RuntimeError):
    """An episode failed on one rollout worker; the message names the worker."""

    def __init__(self, rank: int, address: str, message: str):
        self.rank, self.address = rank, address
        super().__init__(f"rollout worker {rank} at {address} {message}")


class RolloutWorkerLost(RolloutWorkerError):
    """The worker's connection died or it stopped answering: its episodes in flight failed, it gets no more."""


class NoRolloutWorkers(RuntimeError):
    """Every rollout worker has been lost."""


@dataclasses.dataclass
class _Worker:
    rank: int
    address: str
    episodes: RpcClient  # run_episode
    control: RpcClient  # ping, set_resumed, set_servers, shutdown
    lost: asyncio.Future[str]  # its result is why the worker was lost
    in_flight: int = 0  # episodes sent and not yet answered
    completed: int = 0  # groups it returned


class RemoteEpisodes:
    """The rollout workers of a run; ``async with`` opens their connections and starts the heartbeats."""

    def __init__(
        self,
        addresses: Sequence[str],  # rollout worker r's host:port at index r (the registry's entries, by rank)
        token: str,  # the run's secret (hpcrl.rpc.auth.read_token)
        episode_timeout_s: float = 3600.0,  # deadline of one episode call: a backstop, heartbeats find dead workers
        heartbeat_s: float = 5.0,  # seconds between two pings of a worker
        heartbeat_timeout_s: float = 30.0,  # deadline of a ping or control call; missing it loses the worker
        max_in_flight: int = 1024,  # episodes one worker may run at once (rollout.max_concurrent bounds the sum)
    ):
        if isinstance(addresses, str) or not addresses:
            raise ValueError(f"RemoteEpisodes needs a non-empty list of host:port addresses, got {addresses!r}")
        self.addresses, self.token = list(addresses), token
        self.episode_timeout_s = episode_timeout_s
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_in_flight = max_in_flight
        for name in ("episode_timeout_s", "heartbeat_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RemoteEpisodes: {name} must be seconds > 0, got {getattr(self, name)!r}")
        self._workers: list[_Worker] = []
        self._heartbeats: list[asyncio.Task] = []
        self._clients = contextlib.AsyncExitStack()
        self._cursor = 0  # where the next tie-break scan starts

    async def __aenter__(self) -> RemoteEpisodes:
        loop = asyncio.get_running_loop()
        for rank, address in enumerate(self.addresses):
            episodes = RpcClient(
                [address], self.token, timeout_s=self.episode_timeout_s, max_connections=self.max_in_flight
            )
            control = RpcClient([address], self.token, timeout_s=self.heartbeat_timeout_s)
            await self._clients.enter_async_context(episodes)
            await self._clients.enter_async_context(control)
            self._workers.append(_Worker(rank, address, episodes, control, loop.create_future()))
        self._heartbeats = [
            asyncio.create_task(self._heartbeat(w), name=f"rollout-heartbeat-{w.rank}") for w in self._workers
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop_heartbeats()
        await self._clients.aclose()

    # --- what the controller calls ----------------------------------------------------------------------

    async def run(self, row: Mapping[str, Any], seed: int | None = None) -> Group:
        """One episode of ``row`` (its ``prompt`` and ``answer``) on the least-loaded live worker."""
        worker = self._pick()
        request = EpisodeRequest.of(row, seed)
        worker.in_flight += 1
        call = asyncio.create_task(worker.episodes.call("run_episode", [request]))
        try:
            either: set[asyncio.Future[Any]] = {call, worker.lost}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():  # lost through another call or a heartbeat: this reply is not coming
                raise self._lost_error(worker)
            group = self._group(worker, call)
        finally:
            worker.in_flight -= 1
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        worker.completed += 1
        return group

    async def pause(self) -> None:
        """Tell every live worker that generation is paused: samples that come back aborted wait."""
        await self._set_resumed(False)

    async def resume(self) -> None:
        """Tell every live worker that generation goes on: waiting samples resubmit."""
        await self._set_resumed(True)

    async def set_servers(self, addresses: list[str]) -> None:
        """Make every live worker's inference pool exactly ``addresses``: requests go to these servers only.

        The controller calls it when an inference server restarted (perhaps at a new address) or died, so
        that every worker sends its next requests to the servers that are there. An empty list is allowed:
        the workers' requests then wait for a server to join (``InferenceClient.set_servers``)."""
        await self._broadcast("set_servers", SetServers(list(addresses)), f"set_servers({list(addresses)})")

    async def shutdown(self) -> None:
        """Ask every live worker to stop (it ends its reward processes and exits 0); no episode runs after."""
        await self._stop_heartbeats()
        live = self.live()
        results = await asyncio.gather(*(w.control.shutdown() for w in live), return_exceptions=True)
        for worker, result in zip(live, results, strict=True):
            if isinstance(result, Exception):  # it is gone already: the scheduler reports why
                log.warning("rollout worker %d at %s did not answer shutdown: %s", worker.rank, worker.address, result)
        for worker in self._workers:
            _set_lost(worker, "shut down by the controller")

    def live(self) -> list[_Worker]:
        """The workers still in service, by rank."""
        return [w for w in self._workers if not w.lost.done()]

    @property
    def completed(self) -> dict[int, int]:
        """Groups each worker returned, by rank (metrics: how evenly the work spreads)."""
        return {w.rank: w.completed for w in self._workers}

    # --- inside -----------------------------------------------------------------------------------------

    def _pick(self) -> _Worker:
        if not self._workers:
            raise RuntimeError("RemoteEpisodes is not open; use it as `async with RemoteEpisodes(...) as remote:`")
        live = self.live()
        if not live:
            reasons = "; ".join(f"worker {w.rank} at {w.address}: {w.lost.result()}" for w in self._workers)
            raise NoRolloutWorkers(
                f"no rollout worker is left to run episodes ({reasons}); see their logs, logs/rollout-<rank>.log "
                "in the run directory"
            )
        n = len(self._workers)
        order = [self._workers[(self._cursor + i) % n] for i in range(n)]
        choice = min((w for w in order if not w.lost.done()), key=lambda w: w.in_flight)  # first of equals
        self._cursor = (choice.rank + 1) % n
        return choice

    def _group(self, worker: _Worker, call: asyncio.Task) -> Group:
        try:
            return call.result()[0]
        except RpcConnectionError as e:
            self._lose(worker, e.message)
            raise self._lost_error(worker) from e
        except RemoteError as e:
            raise RolloutWorkerError(
                worker.rank,
                worker.address,
                f"failed the episode: {e.error_type}: {e.message}\n--- remote traceback ---\n{e.traceback.rstrip()}",
            ) from e
        except RpcError as e:
            raise RolloutWorkerError(worker.rank, worker.address, f"refused the episode: {e.message}") from e

    def _lost_error(self, worker: _Worker) -> RolloutWorkerLost:
        why, left, of = worker.lost.result(), len(self.live()), len(self._workers)
        return RolloutWorkerLost(
            worker.rank, worker.address, f"was lost ({why}): its episodes in flight failed; {left} of {of} remain"
        )

    def _lose(self, worker: _Worker, why: str) -> None:
        if _set_lost(worker, why):
            log.error(
                "rollout worker %d at %s was lost (%s): %d episodes in flight fail, later ones go to workers %s",
                worker.rank,
                worker.address,
                why,
                worker.in_flight,
                [w.rank for w in self.live()],
            )

    async def _heartbeat(self, worker: _Worker) -> None:
        while not worker.lost.done():
            await asyncio.sleep(self.heartbeat_s)
            try:
                await worker.control.call("ping", [Ping()])
            except RpcError as e:
                self._lose(worker, f"missed a heartbeat: {e.message}")

    async def _stop_heartbeats(self) -> None:
        for task in self._heartbeats:
            task.cancel()
        await asyncio.gather(*self._heartbeats, return_exceptions=True)
        self._heartbeats = []

    async def _set_resumed(self, resumed: bool) -> None:
        await self._broadcast("set_resumed", SetResumed(resumed), f"set_resumed({resumed})")

    async def _broadcast(self, method: str, request: Any, what: str) -> None:
        """Send ``request`` to every live worker's control client at once; ``what`` names the call in errors.

        A worker that gives no reply is lost (its episodes fail) and the call goes on for the others, which
        must still pause, resume or change servers. A worker that refused (its handler raised) stays in
        service: the lowest such rank's refusal is raised, once every silent worker has been marked lost."""
        live = self.live()
        results = await asyncio.gather(*(w.control.call(method, [request]) for w in live), return_exceptions=True)
        refusals: list[tuple[_Worker, Exception]] = []
        for worker, result in zip(live, results, strict=True):
            if isinstance(result, RpcConnectionError):
                self._lose(worker, f"{what} got no reply: {result.message}")
            elif isinstance(result, Exception):
                refusals.append((worker, result))
        if refusals:
            worker, error = refusals[0]
            refused = RolloutWorkerError(worker.rank, worker.address, f"refused {what}: {error}")
            for other, its_error in refusals[1:]:
                first_line = str(its_error).splitlines()[0]
                refused.add_note(f"rollout worker {other.rank} at {other.address} refused it too: {first_line}")
            raise refused from error


def _set_lost(worker: _Worker, why: str) -> bool:
    """Mark the worker lost (once); True if this call did."""
    if worker.lost.done():
        return False
    worker.lost.set_result(why)
    return True
