"""Leases on real endpoints in threads: a worker ends when renewals stop, and only its own controller's count; its
setup grace ends at the controller's first contact; the keeper renews every registered worker and names the one it
cannot reach; the endpoint wants the token."""

import asyncio
import http.client
import json
import re
import threading
import time

import pytest

from hpcrl.launch.lease import Lease, LeaseKeeper
from hpcrl.launch.registry import Entry, Registry
from hpcrl.net import parse_hostport
from hpcrl.rpc import AuthError, RpcClient, RpcServer
from hpcrl.rpc.messages import Ping

TOKEN = "lease-token-" + "x" * 32


class Expiry:
    def __init__(self) -> None:
        self.at: float | None = None
        self.why = ""
        self.done = threading.Event()

    def __call__(self, why: str) -> None:
        self.at, self.why = time.monotonic(), why
        self.done.set()


def worker(registry: Registry, role: str, rank: int, controller: str, lease_s: float) -> Lease:
    expiry = Expiry()
    lease = Lease(controller, lease_s, expiry, poll_s=0.05).start()
    address = lease.serve(TOKEN, "127.0.0.1", 0, "127.0.0.1")
    registry.register(Entry(role, rank, "127.0.0.1", 1, node=f"node{rank}", extra={"lease": address}))
    lease.expiry = expiry  # type: ignore[attr-defined]
    return lease


def test_a_lease_that_is_not_renewed_expires_after_its_time_and_grace():
    expiry = Expiry()
    start = time.monotonic()
    Lease("c1", 0.4, expiry, grace_s=0.3, poll_s=0.02).start()
    assert expiry.done.wait(5)
    assert 0.7 <= expiry.at - start < 1.2, expiry.at - start
    assert "no word from controller c1" in expiry.why


def test_a_worker_that_registered_and_was_never_renewed_expires_without_the_rest_of_its_setup_grace():
    expiry = Expiry()
    lease = Lease("c1", 0.4, expiry, grace_s=600, poll_s=0.02, registry_seen_s=0.5).start()
    time.sleep(0.3)  # setting up, within the grace
    start = time.monotonic()
    lease.serve(TOKEN, "127.0.0.1", 0, "127.0.0.1")  # set up: its endpoint goes into the registry
    assert expiry.done.wait(5), "the controller died before its first renewal: the worker must not wait 600 s"
    assert 0.85 <= expiry.at - start < 1.4, expiry.at - start  # the registry's delay, then the lease
    lease.stop()


def test_the_controller_s_first_rpc_call_ends_the_grace_and_a_lease_without_renewal_then_ends_the_worker():
    expiry = Expiry()
    lease = Lease("c1", 0.5, expiry, grace_s=600, poll_s=0.02).start()
    lease.serve(TOKEN, "127.0.0.1", 0, "127.0.0.1")  # registered: the registry's 60 s and a lease to go
    with RpcServer({"echo": lambda msg: msg}, TOKEN, 0, on_authenticated=lease.contact) as server:
        with pytest.raises(AuthError):  # a stranger is not the controller
            rpc_call(server.address, "wrong-token")
        time.sleep(0.7)
        assert not expiry.done.is_set() and not lease.contacted
        start = time.monotonic()
        assert rpc_call(server.address, TOKEN) == Ping()  # the controller's first step, say; then it dies
        assert expiry.done.wait(5), "called by the controller but never renewed: the worker must not wait 60 s"
    assert 0.45 <= expiry.at - start < 1.0, expiry.at - start  # one lease from the call
    lease.stop()


def test_contact_never_moves_a_lease_s_deadline_later():
    lease = Lease("c1", 10, Expiry(), grace_s=600)
    lease.renew("c1")
    renewed = lease.deadline
    time.sleep(0.05)
    lease.contact()  # a connection opened after the renewal
    assert lease.deadline == renewed and lease.contacted


def rpc_call(address: str, token: str):
    async def go():
        async with RpcClient([address], token, connect_timeout_s=5) as client:
            return (await client.call("echo", [Ping()]))[0]

    return asyncio.run(go())


def post(address: str, body: bytes, token: str = TOKEN, path: str = "/lease") -> tuple[int, dict]:
    host, port = parse_hostport(address)
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {token}"})
    response = conn.getresponse()
    said = json.loads(response.read())
    conn.close()
    return response.status, said


def test_only_renewals_from_its_own_controller_keep_a_worker_alive():
    expiry = Expiry()
    lease = Lease("mine", 0.5, expiry, poll_s=0.02).start()
    address = lease.serve(TOKEN, "127.0.0.1", 0, "127.0.0.1")
    for _ in range(6):  # 0.9 s of renewals: well past one lease
        assert post(address, b'{"controller": "mine"}') == (200, {"ok": True, "controller": "mine"})
        time.sleep(0.15)
    assert not expiry.done.is_set()
    start = time.monotonic()
    for _ in range(6):  # a rerun's controller, resuming the run: its renewals do not count
        assert post(address, b'{"controller": "other"}') == (200, {"ok": False, "controller": "mine"})
        time.sleep(0.15)
    assert expiry.done.is_set() and expiry.at - start < 0.7
    lease.stop()


def test_the_endpoint_wants_the_run_s_token_before_anything_else():
    lease = Lease("mine", 60, Expiry())
    address = lease.serve(TOKEN, "127.0.0.1", 0, "127.0.0.1")
    assert post(address, b'{"controller": "mine"}', token="wrong")[0] == 401
    assert post(address, b"garbage", token="wrong")[0] == 401
    assert post(address, b"garbage")[0] == 400
    assert post(address, b"{}", token="wrong", path="/other")[0] == 401, "no route is looked up before the token"
    assert post(address, b"{}", path="/other")[0] == 404
    assert lease.renewals == 0
    lease.stop()


class Lost(list):
    def __call__(self, entry: Entry, why: str) -> None:
        self.append((entry.role, entry.rank, why, time.monotonic()))


def test_the_keeper_renews_every_registered_worker_and_names_one_it_cannot_reach(tmp_path):
    registry = Registry(tmp_path)
    lease_s = 1.5
    a, b = (worker(registry, "trainer", rank, "ctl", lease_s) for rank in (0, 1))
    lost = Lost()
    with LeaseKeeper(registry, ["trainer"], "ctl", TOKEN, lease_s, lost) as keeper:
        time.sleep(2 * lease_s)  # two leases: every renewal got through
        assert lost == [] and a.renewals >= 4 and b.renewals >= 4 and not a.expiry.done.is_set()
        b.stop()  # unreachable from now on (its node cut off, say)
        cut = time.monotonic()
        time.sleep(3 * lease_s)
    a.stop()
    ((role, rank, why, when),) = lost  # once, and only b
    assert (role, rank) == ("trainer", 1)
    assert re.match(r"on node node1 \(127\.0\.0\.1:1\) has not answered the controller for \d+ s", why), why
    # a whole lease since its last answer, which came at most one renewal interval before the cut
    assert lease_s - keeper.interval_s < when - cut < lease_s + 1.5


def test_a_worker_let_go_from_the_registry_is_not_lost(tmp_path):
    registry = Registry(tmp_path)
    lease = worker(registry, "server", 0, "ctl", 1.0)
    lost = Lost()
    with LeaseKeeper(registry, ["server"], "ctl", TOKEN, 1.0, lost):
        time.sleep(0.5)
        registry.unregister("server", 0)  # the controller dropped it (it died and left the pool)
        lease.stop()
        time.sleep(2.5)
    assert lost == []


def test_workers_end_once_their_keeper_stops(tmp_path):
    """The controller gone (SIGKILL): nobody renews, and every worker's lease runs out."""
    registry = Registry(tmp_path)
    leases = [worker(registry, "rollout", rank, "ctl", 1.0) for rank in range(3)]
    keeper = LeaseKeeper(registry, ["rollout"], "ctl", TOKEN, 1.0, Lost()).start()
    time.sleep(1.5)
    assert not any(lease.expiry.done.is_set() for lease in leases)
    keeper.stop()
    stopped = time.monotonic()
    for lease in leases:
        assert lease.expiry.done.wait(3)
        assert lease.expiry.at - stopped < 1.5
        lease.stop()


def test_the_keeper_stops_at_once_between_renewals(tmp_path):
    """stop() wakes the keeper from its wait for the next renewal (lease_s / 6, here 20 s) instead of waiting it out."""
    registry = Registry(tmp_path)
    lease = worker(registry, "trainer", 0, "ctl", 120.0)
    keeper = LeaseKeeper(registry, ["trainer"], "ctl", TOKEN, 120.0, Lost()).start()
    deadline = time.monotonic() + 10
    while lease.renewals == 0 and time.monotonic() < deadline:  # the first renewal done: now it waits 20 s
        time.sleep(0.02)
    assert lease.renewals == 1
    asked = time.monotonic()
    keeper.stop()
    assert not keeper._thread.is_alive()
    assert time.monotonic() - asked < keeper.interval_s / 4
    lease.stop()
