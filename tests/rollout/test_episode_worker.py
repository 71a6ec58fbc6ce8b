"""Rollout workers as real processes: started by LocalScheduler beside a real CPU inference server, driven by
RemoteEpisodes. Each worker reads the server's address from the run's registry, as it does in a run."""

import asyncio
import contextlib
import os
import signal
import sys
import time

import aiohttp
import psutil
import pytest
from aiohttp import web

from hpcrl.config.load import dump_config
from hpcrl.config.schema import (
    AlgorithmConfig,
    AllocationConfig,
    ClusterConfig,
    Config,
    ModelConfig,
    NetConfig,
    RewardConfig,
    RoleAllocation,
    RoleResources,
    RolloutConfig,
    RunConfig,
)
from hpcrl.launch.base import RoleSpec, WorkerFailed
from hpcrl.launch.local import LocalScheduler
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slots import PortSlots
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.reward.builtin import mod10
from hpcrl.rollout.remote import NoRolloutWorkers, RemoteEpisodes, RolloutWorkerError, RolloutWorkerLost
from hpcrl.rollout.workflows.base import Group, Sample
from hpcrl.rpc.auth import create_token
from hpcrl.rpc.wire import decode, encode
from hpcrl.rundir import RunDir
from tests.inference.test_client_fakes import FakeServer

GROUP_SIZE = 2
MAX_NEW_TOKENS = 4
ROWS = [{"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)} for a, b in [(3, 4), (1, 2), (5, 5), (9, 8)]]


def make_run(tmp_path, model_path, server_address: str, setup_timeout_s: float = 120) -> tuple[RunDir, str]:
    cfg = Config(
        run=RunConfig(root=str(tmp_path)),
        model=ModelConfig(source="local", path=str(model_path)),
        allocation=AllocationConfig(
            server=RoleAllocation(backend="cpu", workers=1),
            trainer=RoleAllocation(backend="fsdp", workers=1, gpus_per_worker=0),
        ),
        cluster=ClusterConfig(
            net=NetConfig(advertise_host="127.0.0.1"),
            roles={
                "server": RoleResources(),
                "trainer": RoleResources(),
                "rollout": RoleResources(setup_timeout_s=setup_timeout_s),
            },
        ),
        algorithm=AlgorithmConfig(group_size=GROUP_SIZE),
        rollout=RolloutConfig(max_new_tokens=MAX_NEW_TOKENS, request_timeout_s=60),
        reward=RewardConfig(fn="tests.controller.rewards:mod10_in_processes", workers=1),  # a process each
    )
    run_dir = RunDir.create(tmp_path, cfg.run.experiment, cfg.run.trial)
    run_dir.write_config(dump_config(cfg))
    if server_address:  # as the server worker does once its server is healthy
        host, port = server_address.rsplit(":", 1)
        Registry(run_dir.registry).register(Entry("server", 0, host, int(port)))
    return run_dir, create_token(run_dir.path)


def rollout_workers(run_dir: RunDir, workers: int = 2) -> tuple[LocalScheduler, RoleSpec, PortSlots]:
    spec = RoleSpec("rollout", [sys.executable, "-m", "hpcrl.rollout.episode_worker"], workers, setup_timeout_s=120)
    slots = PortSlots({"server": 1, "trainer": 1, "rollout": workers})
    return LocalScheduler(run_dir, slots, grace_s=5), spec, slots


def check_group(group: Group, row: dict, tokenizer) -> None:
    assert (group.prompt, group.answer) == (row["prompt"], row["answer"])
    assert group.prompt_ids == tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    assert len(group.samples) == GROUP_SIZE
    for s in group.samples:
        assert 1 <= len(s.output_ids) <= MAX_NEW_TOKENS and len(s.logprobs) == len(s.output_ids)
        assert s.versions == [0] * len(s.output_ids)  # the servers' first weights
        assert s.text == tokenizer.decode(s.output_ids, skip_special_tokens=True)
        assert (s.reward, s.reward_error) == (mod10(row["prompt"], s.text, row["answer"]), None)


def worker_tree(pid: int) -> list[psutil.Process]:
    me = psutil.Process(pid)
    return [me, *me.children(recursive=True)]


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def connections_to(pid: int, port: int) -> int:
    """Open TCP connections from process ``pid`` to ``port``: its requests in flight there (and idle keep-alives)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sum(1 for c in conns if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


async def until(condition, what: str, check_alive=lambda: None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        check_alive()
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(0.05)


def test_a_group_crosses_the_wire_unchanged():
    sample = Sample([5, 6], [-0.5, -1], [3, -1], "abort", "ab", None, "timed out", [1, 0], 2)
    recomputed = Sample([8], None, [4], "stop", "d", 0.0)  # behaviour_logprobs=recompute: the servers gave none
    group = Group("3+4=", "7", [1, 2, 3], [sample, Sample([7], [0.0], [4], "stop", "c", 1.0), recomputed])
    assert decode(encode(group)) == group


def test_two_workers_start_at_once_on_their_own_ports_and_both_run_episodes(tiny_model, server, tmp_path):
    run_dir, token = make_run(tmp_path, tiny_model, server.address)
    tokenizer = load_tokenizer(tiny_model)
    scheduler, spec, slots = rollout_workers(run_dir)
    with scheduler:
        group = scheduler.start(spec)  # both spawned back to back
        entries = group.wait_ready()
        assert [e.rank for e in entries] == [0, 1] and entries[0].port != entries[1].port
        for e in entries:
            low, high = slots.allocator(slots.slot("rollout", e.rank)).slice
            assert low <= e.port < high, f"rollout worker {e.rank} took a port outside its own slot"

        async def drive() -> None:
            async with RemoteEpisodes([e.address for e in entries], token, heartbeat_s=0.5) as remote:
                groups = await asyncio.gather(*(remote.run(row) for row in ROWS * 2))
                for got, row in zip(groups, ROWS * 2, strict=True):
                    check_group(got, row, tokenizer)
                assert remote.completed == {0: 4, 1: 4}, "the least-loaded worker takes each episode"

                # paused (a weight update): samples wait on the workers; resumed: they go on
                await remote.pause()
                waiting = [asyncio.ensure_future(remote.run(row)) for row in ROWS]
                done, _ = await asyncio.wait(waiting, timeout=1.0)
                assert not done, "episodes ran while the workers were told generation is paused"
                await remote.resume()
                for got, row in zip(await asyncio.gather(*waiting), ROWS, strict=True):
                    check_group(got, row, tokenizer)

                # an episode that fails on its worker names it and brings the traceback; the worker stays
                with pytest.raises(RolloutWorkerError, match=r"rollout worker \d at .* failed the episode") as err:
                    await remote.run({"prompt": "", "answer": "1"})
                assert "is empty; a prompt needs at least one token" in str(err.value)
                assert "remote traceback" in str(err.value)
                assert [w.rank for w in remote.live()] == [0, 1]

                # SIGTERM (a scheduler's stop) and the shutdown RPC: each worker unregisters, ends its reward
                # processes and exits, 128 + 15 and 0
                trees = [worker_tree(e.pid) for e in entries]
                assert all(len(tree) > 1 for tree in trees), "each worker has its reward process"
                os.kill(entries[1].pid, signal.SIGTERM)
                await until(lambda: group.children[1].poll() is not None, "worker 1 exiting on SIGTERM")
                await remote.shutdown()
                await until(lambda: group.children[0].poll() is not None, "worker 0 exiting on shutdown")
                assert [child.poll() for child in group.children] == [0, 143]
                await until(lambda: not any(alive(p) for tree in trees for p in tree), "reward processes ending")
                assert scheduler.registry.entries("rollout") == [], "a stopped worker unregisters"

        asyncio.run(drive())
    assert "received SIGTERM" in run_dir.log_file("rollout", 1).read_text()
    assert "stopped after 6 episodes" in run_dir.log_file("rollout", 0).read_text()


def test_a_killed_worker_fails_only_its_own_episodes(tiny_model, server, tmp_path):
    run_dir, token = make_run(tmp_path, tiny_model, server.address)
    tokenizer = load_tokenizer(tiny_model)
    scheduler, spec, _ = rollout_workers(run_dir)
    with scheduler:
        group = scheduler.start(spec)
        entries = group.wait_ready()

        async def drive() -> None:
            async with RemoteEpisodes([e.address for e in entries], token, heartbeat_s=0.5) as remote:
                # hold generation, so that every episode is in flight, its requests open at the server
                assert server.post("/pause_generation", {"mode": "in_place"})[0] == 200
                try:
                    rows = ROWS * 2
                    tasks = [asyncio.ensure_future(remote.run(row)) for row in rows]  # worker 1 gets every other one
                    held = len(rows) // 2  # its generate requests, one per group

                    def at_server() -> bool:
                        return connections_to(entries[1].pid, server.port) >= held

                    await until(at_server, "worker 1's requests reaching the server", group.check_alive)
                    os.kill(entries[1].pid, signal.SIGKILL)
                    lost = await asyncio.gather(*tasks[1::2], return_exceptions=True)
                finally:
                    server.post("/continue_generation")
                assert all(isinstance(e, RolloutWorkerLost) for e in lost), lost
                assert {(e.rank, e.address) for e in lost} == {(1, entries[1].address)}
                assert str(lost[0]).startswith(f"rollout worker 1 at {entries[1].address} was lost (")
                for got, row in zip(await asyncio.gather(*tasks[0::2]), rows[0::2], strict=True):
                    check_group(got, row, tokenizer)

                # later episodes go to the worker that is left
                for got, row in zip(await asyncio.gather(*(remote.run(row) for row in ROWS)), ROWS, strict=True):
                    check_group(got, row, tokenizer)
                assert remote.completed == {0: 2 * len(ROWS), 1: 0}
                with pytest.raises(WorkerFailed, match=r"rollout worker 1 exited"):
                    group.check_alive()

                # the heartbeat finds the last worker gone, with no episode in flight; then none is left
                os.kill(entries[0].pid, signal.SIGKILL)
                await until(lambda: not remote.live(), "losing the last worker")
                with pytest.raises(NoRolloutWorkers, match=r"worker 0 at .*missed a heartbeat.*; worker 1 at "):
                    await remote.run(ROWS[0])

        asyncio.run(drive())


def test_a_worker_whose_servers_never_register_fails_at_its_setup_timeout(tiny_model, tmp_path):
    run_dir, _ = make_run(tmp_path, tiny_model, server_address="", setup_timeout_s=1)
    scheduler, spec, _ = rollout_workers(run_dir, workers=1)
    with scheduler:
        group = scheduler.start(spec)
        with pytest.raises(WorkerFailed) as err:
            group.wait_ready()
    message = str(err.value)
    assert message.startswith("rollout worker 0 exited with exit code 1")
    assert "the inference servers did not register" in message and "server ranks [0]" in message


class RelayServer(FakeServer):
    """A FakeServer that relays /generate to a real CPU server: real answers, and a record of every request."""

    def __init__(self, real_address: str):
        super().__init__()
        self.real_address = real_address

    async def _generate(self, body: dict) -> web.Response:
        url = f"http://{self.real_address}/generate"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as reply:
            return web.json_response(await reply.json(), status=reply.status)


@contextlib.asynccontextmanager
async def workers_on_relay(tmp_path, model, real_address: str, workers: int):
    """Rollout workers whose one inference server is the relay ``old``; ``new``, another relay to the same real
    server, is not in their pool. Yields ``(old, new, remote, run_dir)``."""
    old, new = RelayServer(real_address), RelayServer(real_address)
    try:
        await old.start()
        await new.start()
        run_dir, token = make_run(tmp_path, model, old.address)
        scheduler, spec, _ = rollout_workers(run_dir, workers)
        with scheduler:
            group = scheduler.start(spec)
            entries = await asyncio.to_thread(group.wait_ready)  # the relays answer /health meanwhile
            async with RemoteEpisodes([e.address for e in entries], token, heartbeat_s=0.5) as remote:
                yield old, new, remote, run_dir
    finally:
        await new.stop()
        await old.stop()


def prompts_sent(relay) -> int:
    """The prompts in the /generate requests a relay passed on (a group's are one batched request)."""
    return sum(len(body["input_ids"]) for body in relay.bodies("/generate"))


def test_after_set_servers_every_worker_sends_its_requests_to_the_new_server_only(tiny_model, server, tmp_path):
    tokenizer = load_tokenizer(tiny_model)

    async def drive() -> tuple[RunDir, str]:
        async with workers_on_relay(tmp_path, tiny_model, server.address, workers=2) as (old, new, remote, run_dir):
            check_group(await remote.run(ROWS[0]), ROWS[0], tokenizer)
            assert prompts_sent(old) == GROUP_SIZE and prompts_sent(new) == 0

            await remote.set_servers([new.address])  # the server restarted at another address
            groups = await asyncio.gather(*(remote.run(row) for row in ROWS))
            for got, row in zip(groups, ROWS, strict=True):
                check_group(got, row, tokenizer)
            assert remote.completed == {0: 3, 1: 2}, "both workers ran episodes after set_servers"
            assert prompts_sent(old) == GROUP_SIZE, "a request went to the server that left the pool"
            assert prompts_sent(new) == len(ROWS) * GROUP_SIZE
            return run_dir, new.address

    run_dir, new_address = asyncio.run(drive())
    for rank in (0, 1):
        log = run_dir.log_file("rollout", rank).read_text()
        assert f"inference servers now: {new_address} (were: 127.0.0.1:" in log, log


def test_set_servers_with_a_malformed_address_is_refused_and_changes_nothing(tiny_model, server, tmp_path):
    tokenizer = load_tokenizer(tiny_model)

    async def drive() -> None:
        async with workers_on_relay(tmp_path, tiny_model, server.address, workers=1) as (old, new, remote, _):
            refused = r"rollout worker 0 at \S+ refused set_servers\(.*\): .*cannot parse address 'no-port'"
            with pytest.raises(RolloutWorkerError, match=refused) as err:
                await remote.set_servers([new.address, "no-port"])
            assert "ValueError" in str(err.value) and not isinstance(err.value, RolloutWorkerLost)
            assert [w.rank for w in remote.live()] == [0], "a refused set_servers must not lose the worker"

            check_group(await remote.run(ROWS[0]), ROWS[0], tokenizer)  # the worker still serves, on its old pool
            assert prompts_sent(old) == GROUP_SIZE and prompts_sent(new) == 0

    asyncio.run(drive())
