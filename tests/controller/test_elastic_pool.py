"""The server pool of an elastic fleet (``allocation.server.min_workers``), with a fake worker group and weight sync:
the last server may leave, a requeued one leaves and rejoins without counting as a restart, and servers the
controller did not start join with the newest weights and leave for good."""

import asyncio
import logging
from dataclasses import replace

import pytest

from hpcrl.config.schema import Config
from hpcrl.controller.servers import ServerPool
from hpcrl.inference.client import InferenceClient
from hpcrl.launch.base import RoleSpec, WorkerFailed, WorkerRequeued
from hpcrl.launch.registry import Entry, Registry


class FakeGroup:
    """A server group whose failures the test raises, with a real registry."""

    def __init__(self, registry: Registry, workers: int):
        self.registry, self.lost, self.raise_next = registry, {}, None
        self.spec = RoleSpec("server", ["true"], workers=workers, setup_timeout_s=60)
        self.dropped, self.restarted = [], []

    def check_alive(self):
        failure, self.raise_next = self.raise_next, None
        if failure is not None:
            raise failure
        for rank, why in self.lost.items():
            raise WorkerFailed("server", rank, why, "")

    def queued(self):
        return False

    def drop(self, rank):
        self.dropped.append(rank)
        self.registry.unregister("server", rank)

    def restart(self, rank):
        self.restarted.append(rank)
        self.registry.unregister("server", rank)


class FakeSync:
    def __init__(self, version: int):
        self.lock, self.version, self.loaded = asyncio.Lock(), version, []

    async def load_current(self, servers):
        self.loaded.append((servers, self.version))
        return self.version


def pool_of(tmp_path, workers=2, min_workers=1, on_server_exit="drop"):
    cfg = Config()
    cfg = replace(cfg, allocation=replace(cfg.allocation, server=replace(cfg.allocation.server, workers=workers)))
    server = replace(cfg.allocation.server, min_workers=min_workers)
    cfg = replace(cfg, allocation=replace(cfg.allocation, server=server))
    cfg = replace(cfg, inference=replace(cfg.inference, on_server_exit=on_server_exit))
    (tmp_path / "registry").mkdir()
    registry = Registry(tmp_path / "registry")
    entries = [Entry("server", rank, "h", 100 + rank) for rank in range(workers)]
    for entry in entries:
        registry.register(entry)
    pool = ServerPool(cfg, FakeGroup(registry, workers), entries)
    pool.client = InferenceClient([e.address for e in entries], min_servers=min_workers or 1)
    pool.sync = FakeSync(version=7)
    return pool


def test_the_last_server_of_an_elastic_fleet_may_leave_and_the_pool_says_it_waits(tmp_path, caplog):
    pool = pool_of(tmp_path, workers=2, min_workers=2)
    pool.group.raise_next = WorkerFailed("server", 1, "NODE_FAIL", "")
    with caplog.at_level(logging.WARNING):
        pool.check()
    assert pool.client.addresses == ["h:100"] and pool.lost == 1 and pool.group.dropped == [1]
    assert "1 servers live, fewer than allocation.server.min_workers=2" in caplog.text
    pool.group.raise_next = WorkerFailed("server", 0, "NODE_FAIL", "")
    pool.check()  # not elastic, the last one would fail the run
    assert pool.client.addresses == []


def test_without_min_workers_the_last_server_does_not_leave(tmp_path):
    pool = pool_of(tmp_path, workers=1, min_workers=None)
    pool.group.raise_next = WorkerFailed("server", 0, "NODE_FAIL", "")
    with pytest.raises(WorkerFailed):
        pool.check()


def test_a_requeued_server_leaves_and_rejoins_with_the_newest_weights_and_is_no_restart(tmp_path):
    pool = pool_of(tmp_path, workers=2, min_workers=1, on_server_exit="restart")
    pool.group.registry.unregister("server", 0)  # the fleet forgets its stale entry before it says so
    pool.group.raise_next = WorkerRequeued("server", 0, "REQUEUED", "")
    pool.check()
    assert pool.client.addresses == ["h:101"] and 0 in pool.restarting
    assert (pool.restarts, pool.group.restarted) == (0, []), "Slurm brings it back: no restart of the pool's"
    asyncio.run(pool.rejoin())
    assert pool.client.addresses == ["h:101"], "it has not registered again yet"
    pool.group.registry.register(Entry("server", 0, "h2", 200))
    asyncio.run(pool.rejoin())
    assert pool.client.addresses == ["h:101", "h2:200"] and pool.sync.loaded == [(["h2:200"], 7)]
    assert pool.addresses[0] == "h2:200" and not pool.restarting


def test_a_server_that_joins_loads_the_newest_weights_before_it_takes_requests_and_leaves_for_good(tmp_path, caplog):
    pool = pool_of(tmp_path, workers=1, min_workers=1)
    pool.group.registry.register(Entry("server", 5, "j", 300))
    with caplog.at_level(logging.WARNING):
        asyncio.run(pool.rejoin())
    assert pool.sync.loaded == [(["j:300"], 7)] and pool.client.addresses == ["h:100", "j:300"]
    assert (pool.joins, pool.joined) == (1, {5})
    assert "server worker 5 joined the run from node" in caplog.text and "with weights version 7" in caplog.text
    asyncio.run(pool.rejoin())
    assert pool.joins == 1, "it joins once"
    pool.group.registry.unregister("server", 5)  # it stopped
    pool.check()
    assert pool.client.addresses == ["h:100"] and pool.lost == 1 and 5 not in pool.addresses
    assert pool.group.dropped == [] and pool.group.restarted == [], "the controller never started it"


def test_a_joined_server_the_lease_keeper_lost_leaves_and_its_entry_is_forgotten(tmp_path):
    pool = pool_of(tmp_path, workers=1, min_workers=1)
    pool.group.registry.register(Entry("server", 3, "j", 300))
    asyncio.run(pool.rejoin())
    pool.group.lost[3] = "did not answer its lease for 31 s"
    pool.check()  # the group's own check would raise for the lost rank: the pool takes it first
    assert pool.client.addresses == ["h:100"] and not pool.group.lost
    assert [e.rank for e in pool.group.registry.entries("server")] == [0], "its entry cannot bring it back"
    asyncio.run(pool.rejoin())
    assert pool.client.addresses == ["h:100"]


def test_a_run_that_is_not_elastic_ignores_entries_it_did_not_start(tmp_path):
    pool = pool_of(tmp_path, workers=1, min_workers=None)
    pool.group.registry.register(Entry("server", 4, "j", 300))
    asyncio.run(pool.rejoin())
    assert pool.client.addresses == ["h:100"] and pool.sync.loaded == []
