"""The inference servers' pool while the loop runs, and what happens when one dies (``inference.on_server_exit``).

    drop     the dead server leaves the client's pool: requests retry on the others, and the run goes on
             without it (not the last one: with none left the run fails)
    restart  it leaves the pool and its worker starts again (same rank, log file and port slot); once the new
             one has registered it loads the newest weights (the last disk export, tagged with its version)
             and rejoins. While no server is left, requests wait for one (``InferenceClient.no_server_timeout_s``).
             At most ``inference.max_restarts`` restarts in a run; the next death fails the run
    fail     the run fails naming the server

Both need disk weight sync. Locally one worker restarts; on Slurm one job (or srun step) holds all of the
role's servers and ends when one of them dies (``--kill-on-bad-exit``), so ``restart`` starts the role again:
a new job (``cluster.submit_mode=per_role``) or a new step in its het group (``steps``), whose time in the
queue does not count against the setup timeout. ``drop`` is local only, and in one heterogeneous job
(``hetjob``) the roles share the job's fate: there a dead server fails the run (config checks refuse
``restart``). Rollout workers are told every change of the pool.

An elastic fleet (``allocation.server.min_workers`` set) changes three things. A dead server may leave even when
it is the last: below ``min_workers`` live servers new requests wait for more (``InferenceClient.min_servers``,
with the same deadline). On Slurm each server is a job of its own (``launch/slurm/fleet.py``), so ``drop`` and
``restart`` act on that server's job alone (``restart`` submits a replacement job), and a job Slurm requeues
(preempted, a job submitted with ``--requeue``) leaves the pool and rejoins once it registers again, counting as
no restart. And servers the controller did not start may join: a registry entry of a rank the pool does not know
(``python -m hpcrl.inference.join RUN_DIR``) loads the newest weights as a restarted server does and enters the
pool; one that leaves (its entry gone) or that the lease keeper loses is let go, never restarted.

The watchdog calls ``check`` (plain) every second, and runs ``rejoin`` (async) as a task of its own, never
waiting on it: loading weights may take long, and a worker that dies meanwhile must still be noticed.
``rejoin`` holds the weight sync's lock, so a restarted server joins either before a weight sync, which then
includes it, or after one, and loads that sync's export: it never serves weights older than the others'. A
server that dies again while it loads is restarted by ``check`` meanwhile; the load that was under way then
does not put it back (``_restarted_times`` tells the two apart).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hpcrl.config.schema import Config
from hpcrl.inference.client import InferenceError
from hpcrl.launch.base import Scheduler, WorkerFailed, WorkerGroup, WorkerRequeued
from hpcrl.launch.registry import Entry

log = logging.getLogger(__name__)

ROLE = "server"


class ServerPool:
    """The servers of a run by rank, what happens to a dead one, and counts of both (``servers_lost``,
    ``servers_restarted``). ``client``, ``sync`` and ``episodes`` are set once the loop has opened them."""

    def __init__(self, cfg: Config, group: WorkerGroup, entries: list[Entry], scheduler: Scheduler | None = None):
        self.cfg, self.group, self.scheduler = cfg, group, scheduler
        self.addresses = {e.rank: e.address for e in entries}  # every server's latest address, by rank
        self.client: Any = None  # inference.client.InferenceClient
        self.sync: Any = None  # controller.weights.WeightSync
        self.episodes: Any = None  # rollout.remote.RemoteEpisodes, when rollout workers run the episodes
        self.lost = self.restarts = self.joins = 0
        self.elastic = cfg.allocation.server.min_workers is not None
        self.joined: set[int] = set()  # ranks that joined the run on their own (not started by the controller)
        self.restarting: dict[int, float] = {}  # rank -> the monotonic deadline by which it must register
        self._restarted_times: dict[int, int] = {}  # rank -> times it left the pool to restart
        self._changed = False  # the pool changed and the rollout workers have not been told

    def check(self) -> None:
        """Raise ``WorkerFailed`` if a server died and the run cannot go on without it; else drop or restart it."""
        self._let_go_of_gone_joiners()
        try:
            self.group.check_alive()
        except WorkerFailed as failure:
            if not self._handle(failure):
                raise

    async def rejoin(self) -> None:
        """Restarted servers that have registered load the newest weights and rejoin the pool; one that does
        not register within its setup timeout fails the run."""
        queued = self.restarting and self.group.queued()  # raises past cluster.queue_timeout_min
        for rank, deadline in list(self.restarting.items()):
            entry = next((e for e in self.group.registry.entries(ROLE) if e.rank == rank), None)
            if entry is None:
                if queued:  # time in Slurm's queue does not count
                    self.restarting[rank] = time.monotonic() + self.group.spec.setup_timeout_s
                elif time.monotonic() > deadline:
                    timeout = self.group.spec.setup_timeout_s
                    raise TimeoutError(
                        f"server worker {rank}, restarted, did not register within {timeout:g} s (see "
                        f"logs/server-{rank}.log); raise cluster.roles.server.setup_timeout_s if it was still loading"
                    )
                continue
            if await self._load_and_add(rank, entry.address, self._restarted_times.get(rank, 0)):
                del self.restarting[rank]
        if self.elastic:
            await self._add_joiners()
        if self._changed and self.episodes is not None:
            self._changed = False
            await self.episodes.set_servers(list(self.client.addresses))

    def _handle(self, failure: WorkerFailed) -> bool:
        mode, rank = self.cfg.inference.on_server_exit, failure.worker
        if mode == "fail" or self.cfg.train.weight_sync != "disk":  # a process group would wait for the dead
            return False
        if isinstance(failure, WorkerRequeued):  # Slurm gives it back by itself: no restart of ours
            self._leave(failure.worker)
            rank = failure.worker
            log.warning("server worker %s leaves the pool until it registers again (no restart): %s", rank, failure)
            self._say_if_below_min()
            return True
        if not isinstance(rank, int):  # a Slurm job or step holding all of the role's servers has ended
            return mode == "restart" and self._restart_role(failure)
        if not hasattr(self.group, "restart"):
            return False
        return self._restart(rank, failure) if mode == "restart" else self._drop(rank, failure)

    def _drop(self, rank: int, failure: WorkerFailed) -> bool:
        live = self.client.addresses
        if self.addresses[rank] not in live or (len(live) < 2 and not self.elastic):
            return False
        self.group.drop(rank)
        self.client.remove(self.addresses[rank], last_ok=self.elastic)
        self.lost += 1
        self._changed = True
        log.warning("%s; it leaves the pool, %d servers go on (inference.on_server_exit=drop)", failure, len(live))
        self._say_if_below_min()
        return True

    def _restart(self, rank: int, failure: WorkerFailed) -> bool:
        if not self._may_restart(f"server worker {rank}"):
            return False
        self._leave(rank)
        self.group.restart(rank)
        self._restarted(failure)
        self._say_if_below_min()
        return True

    def _restart_role(self, failure: WorkerFailed) -> bool:
        restart = getattr(self.scheduler, "restart", None)
        if restart is None or not self._may_restart(f"{ROLE} {failure.worker}"):
            return False
        for rank in self.addresses:
            self._leave(rank)
        self.group = restart(self.group)  # raises naming why where it cannot (cluster.submit_mode=hetjob)
        self._restarted(failure)
        return True

    def _may_restart(self, what: str) -> bool:
        limit = self.cfg.inference.max_restarts
        if self.restarts >= limit:
            log.error("%s died after inference.max_restarts=%d restarts: the run fails", what, limit)
        return self.restarts < limit

    def _leave(self, rank: int) -> None:
        """Server ``rank`` leaves the pool until it has restarted (it may be the last one)."""
        if self.addresses[rank] in self.client.addresses:
            self.client.remove(self.addresses[rank], last_ok=True)
        self.restarting[rank] = time.monotonic() + self.group.spec.setup_timeout_s
        self._restarted_times[rank] = self._restarted_times.get(rank, 0) + 1
        self._changed = True

    def _restarted(self, failure: WorkerFailed) -> None:
        self.restarts += 1
        limit = self.cfg.inference.max_restarts
        log.warning("%s; restarting it (restart %d of inference.max_restarts=%d)", failure, self.restarts, limit)

    async def _load_and_add(
        self, rank: int, address: str, restarted_times: int, came: str = "is back in the pool"
    ) -> bool:
        """Give a restarted (or joining) server the newest weights and put it in the pool; False to try again later.
        ``came`` says how it came, in the line logged."""
        async with self.sync.lock:  # no weight sync runs meanwhile: the export read here is the newest
            try:
                loaded = await self.sync.load_current([address])  # the weights, or with LoRA the adapter
            except InferenceError as e:  # e.g. it died again: the next check restarts it or fails the run
                log.warning("restarted server worker %d at %s did not load the weights: %s", rank, address, e)
                return False
            if self._restarted_times.get(rank, 0) != restarted_times:  # it died and restarted while loading
                return False
            self.client.add(address)
        self.addresses[rank] = address
        self._changed = True
        version = "the initial ones" if loaded is None else f"version {loaded}"
        log.warning("server worker %d %s at %s with weights %s", rank, came, address, version)
        return True

    def _say_if_below_min(self) -> None:
        least, live = self.cfg.allocation.server.min_workers, len(self.client.addresses)
        if least is not None and live < least:
            log.warning(
                "%d servers live, fewer than allocation.server.min_workers=%d: rollouts wait up to %g s for servers "
                "to come back or join (python -m hpcrl.inference.join %s)",
                *(live, least, self.client.no_server_timeout_s, self.group.registry.directory.parent),
            )

    async def _add_joiners(self) -> None:
        """Servers that registered on their own (ranks the pool does not know) get the newest weights and join."""
        for entry in self.group.registry.entries(ROLE):
            if entry.rank in self.addresses or entry.rank in self.restarting:
                continue
            if await self._load_and_add(entry.rank, entry.address, 0, f"joined the run from node {entry.node}"):
                self.joined.add(entry.rank)
                self.joins += 1

    def _let_go_of_gone_joiners(self) -> None:
        """A joined server whose entry is gone (it stopped) or that the lease keeper lost leaves the pool for good:
        the controller did not start it, so it neither restarts nor fails the run."""
        registered = {(e.rank, e.address) for e in self.group.registry.entries(ROLE)}
        for rank in sorted(self.joined):
            why = self.group.lost.pop(rank, None)
            if why is None and (rank, self.addresses[rank]) in registered:
                continue
            address = self.addresses.pop(rank)
            self.joined.discard(rank)
            if address in self.client.addresses:
                self.client.remove(address, last_ok=True)
            if (rank, address) in registered:  # lost, not gone: its entry must not bring it back (a new one may)
                self.group.registry.unregister(ROLE, rank)
            self.lost += 1
            self._changed = True
            log.warning("server %d, which joined at %s, left the run: %s", rank, address, why or "it unregistered")
            self._say_if_below_min()
