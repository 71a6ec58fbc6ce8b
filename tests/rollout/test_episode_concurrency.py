"""A rollout worker runs as many episodes at once as the controller sends it: ``RpcServer`` runs coroutine
handlers concurrently, and past the RPC client's default of 100 connections ``RemoteEpisodes(max_in_flight=...)``
sizes the episode client's pool (``RpcClient(max_connections=...)``)."""

import asyncio
import threading
import time

from hpcrl.rollout.remote import EpisodeRequest
from hpcrl.rollout.workflows.base import Group
from hpcrl.rpc.client import RpcClient
from hpcrl.rpc.server import RpcServer

TOKEN = "test-token"
EPISODES = 150


def test_more_than_a_hundred_episodes_run_at_once_on_one_worker():
    running, peak, release = [0], [0], threading.Event()

    async def run_episode(request: EpisodeRequest) -> Group:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        while not release.is_set():
            await asyncio.sleep(0.01)
        running[0] -= 1
        return Group(request.prompt, request.answer, [1])

    server = RpcServer({"run_episode": run_episode}, TOKEN, 0)
    address = server.start_in_thread(timeout_s=30)

    async def send_all() -> list:
        async with RpcClient([address], TOKEN, max_connections=EPISODES) as client:
            calls = [client.call("run_episode", [EpisodeRequest(f"{i}+0=", str(i % 10))]) for i in range(EPISODES)]
            tasks = [asyncio.create_task(call) for call in calls]
            deadline = time.monotonic() + 60
            while peak[0] < EPISODES and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            release.set()
            return await asyncio.gather(*tasks)

    try:
        replies = asyncio.run(send_all())
    finally:
        release.set()
        server.stop()
    assert peak[0] == EPISODES, f"only {peak[0]} of {EPISODES} episodes ran at once"
    assert sorted(reply.prompt for (reply,) in replies) == sorted(f"{i}+0=" for i in range(EPISODES))
