"""The inference client's control path: health waits, pause/resume, weight updates, collectives.

Each test runs fake SGLang-like servers (tests/inference/test_client_fakes.py) on real loopback sockets.
"""

import asyncio
import re

import pytest

from hpcrl.inference.client import InferenceClient, InferenceError
from tests.inference.test_client_fakes import closed_port_address, fake_servers, run


def _named(address: str, text: str) -> bool:
    return re.search(re.escape(address) + r"(?!\d)", text) is not None


def test_wait_healthy_returns_once_a_starting_server_turns_healthy():
    async def body():
        async with fake_servers(2) as [ready, starting], InferenceClient([ready.address, starting.address]) as client:
            starting.health_status = 503
            asyncio.get_running_loop().call_later(0.3, setattr, starting, "health_status", 200)
            calls = []
            await client.wait_healthy(timeout_s=5, check_alive=lambda: calls.append(1), poll_s=0.05)
            assert starting.paths().count("/health") >= 2
            assert ready.paths().count("/health") == 1  # healthy once is enough
            assert len(calls) == starting.paths().count("/health")

    run(body())


def test_wait_healthy_fails_at_once_when_check_alive_raises():
    class JobDied(RuntimeError):
        pass

    def check_alive():
        raise JobDied("slurm job 42 ended with FAILED")

    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address]) as client:
            fake.health_status = 503
            with pytest.raises(JobDied, match="job 42"):
                await client.wait_healthy(timeout_s=600, check_alive=check_alive, poll_s=0.05)

    run(body())


def test_wait_healthy_deadline_names_only_the_unhealthy_servers():
    refused = closed_port_address()

    async def body():
        async with fake_servers(2) as [ready, sick]:
            sick.health_status = 503
            async with InferenceClient([ready.address, sick.address, refused]) as client:
                with pytest.raises(InferenceError) as caught:
                    await client.wait_healthy(timeout_s=0.3, poll_s=0.05)
            message = str(caught.value)
            assert "2 of 3 inference servers not healthy after 0.3 s" in message
            assert _named(sick.address, message) and "HTTP 503" in message
            assert _named(refused, message)
            assert not _named(ready.address, message)
            assert caught.value.server == sick.address

    run(body())


def test_pause_resume_and_cache_calls_reach_every_server():
    async def body():
        async with fake_servers(3) as fakes, InferenceClient([f.address for f in fakes]) as client:
            await client.pause()
            await client.pause("retract")
            await client.resume()
            await client.flush_cache()
            info = await client.model_info()
            with pytest.raises(ValueError, match="pause mode"):
                await client.pause("stop")
            for fake in fakes:
                assert fake.bodies("/pause_generation") == [{"mode": "abort"}, {"mode": "retract"}]
                assert fake.paths() == ["/pause_generation"] * 2 + [
                    "/continue_generation",
                    "/flush_cache",
                    "/model_info",
                ]
            assert info == {f.address: {"model_path": "/fake/model", "weight_version": "3"} for f in fakes}

    run(body())


def test_update_weights_from_disk_reaches_every_server_and_reports_a_failure():
    async def body():
        async with fake_servers(3) as fakes, InferenceClient([f.address for f in fakes]) as client:
            await client.update_weights_from_disk("/ckpt/step_7", weight_version=7)
            expected = {"model_path": "/ckpt/step_7", "weight_version": "7", "flush_cache": True}
            assert all(f.bodies("/update_weights_from_disk") == [expected] for f in fakes)

            fakes[1].success = False
            with pytest.raises(InferenceError, match="reported failure") as caught:
                await client.update_weights_from_disk("/ckpt/step_8", weight_version=8)
            assert caught.value.server == fakes[1].address and fakes[1].address in str(caught.value)

    run(body())


def test_weight_group_calls_run_concurrently_with_per_server_ranks():
    async def body():
        async with fake_servers(2) as fakes, InferenceClient([f.address for f in fakes], tp_size=2) as client:
            barrier = asyncio.Barrier(2)  # like init_process_group: nobody returns until all have joined
            for fake in fakes:
                fake.barrier = barrier
            world = await client.init_weights_update_group("10.0.0.1", 29500)
            assert world == 5 == client.weights_group_world_size()  # trainer rank 0 + 2 servers x 2 TP ranks
            joins = [f.bodies("/init_weights_update_group")[0] for f in fakes]
            assert [j["rank_offset"] for j in joins] == [1, 3]
            assert joins[0] == {
                "master_address": "10.0.0.1",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 5,
                "group_name": "weight_update_group",
                "backend": "gloo",
            }

            await client.begin_weight_update()
            await client.update_weights_from_distributed(
                ["w", "b"], ["bfloat16", "float32"], [(2, 3), (3,)], 9, flush_cache=False
            )
            await client.update_weights_from_distributed(["c"], ["bfloat16"], [(4,)], 9)
            await client.end_weight_update()
            await client.destroy_weights_update_group()
            for fake in fakes:
                first, last = fake.bodies("/update_weights_from_distributed")
                assert first["names"] == ["w", "b"] and first["shapes"] == [[2, 3], [3]]
                assert (first["weight_version"], first["flush_cache"], last["flush_cache"]) == ("9", False, True)
                assert fake.paths()[1:] == [
                    "/begin_weight_update",
                    "/update_weights_from_distributed",
                    "/update_weights_from_distributed",
                    "/end_weight_update",
                    "/destroy_weights_update_group",
                ]
                assert fake.bodies("/begin_weight_update") == [{}] == fake.bodies("/end_weight_update")
                assert fake.bodies("/destroy_weights_update_group") == [{"group_name": "weight_update_group"}]
            with pytest.raises(ValueError, match="one entry per tensor"):
                await client.update_weights_from_distributed(["w"], [], [(1,)], 10)

    run(body())


def test_abort_reaches_every_server_by_rid_or_all():
    async def body():
        async with fake_servers(2) as fakes, InferenceClient([f.address for f in fakes]) as client:
            await client.abort("episode-7-0")
            await client.abort()
            with pytest.raises(ValueError, match="must be a request's rid"):
                await client.abort("")
            for fake in fakes:
                assert fake.bodies("/abort_request") == [{"rid": "episode-7-0"}, {"abort_all": True}]

    run(body())


def test_weight_updates_have_their_own_deadline():
    """A disk load answers after minutes on SGLang: generation's deadline must not cut it off."""

    async def body():
        async with fake_servers(1) as [fake]:
            fake.delay_s = 0.5
            options = {"request_timeout_s": 0.2, "weight_update_timeout_s": 5.0}
            async with InferenceClient([fake.address], **options) as client:
                await client.update_weights_from_disk("/ckpt", weight_version=1)  # 0.5 s: within its 5 s
                await client.begin_weight_update()
                with pytest.raises(InferenceError, match=r"within the 0\.2 s timeout"):
                    await client.model_info()  # everything else keeps request_timeout_s
            async with InferenceClient([fake.address], weight_update_timeout_s=0.2) as client:
                with pytest.raises(InferenceError, match=r"within the 0\.2 s timeout"):
                    await client.update_weights_from_disk("/ckpt", weight_version=2)

    run(body())


def test_weight_group_calls_are_never_retried():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address], max_retries=3, backoff_s=0.01) as client:
            fake.fail_next = [503]
            with pytest.raises(InferenceError, match="1 attempt"):
                await client.init_weights_update_group("10.0.0.1", 29500)
            assert len(fake.bodies("/init_weights_update_group")) == 1

    run(body())


class ClosingServer:
    """A raw HTTP/1.1 server that answers the first request on a connection and keeps it alive, then closes
    the connection when the next request arrives on it, unanswered: what a client meets when uvicorn closes an
    idle keep-alive connection as it sends. ``close_every`` makes it close every connection without answering."""

    def __init__(self, close_every: bool = False) -> None:
        self.close_every = close_every
        self.answered: list[tuple[int, bytes]] = []  # (connection number, request line) of each request answered
        self.connections = 0
        self.address = ""

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return server

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                await reader.readexactly(length)
                if self.close_every or any(n == number for n, _ in self.answered):
                    return  # closed under the request: never answered
                self.answered.append((number, head.split(b"\r\n")[0]))
                body = b'{"success": true, "message": "ok"}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                )
                writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


def test_a_weight_call_whose_keep_alive_connection_closed_is_sent_once_more_on_a_new_one():
    async def body():
        fake = ClosingServer()
        async with await fake.start(), InferenceClient([fake.address], max_retries=0) as client:
            await client.init_weights_update_group("10.0.0.1", 29500)  # connection 1, kept alive
            await client.begin_weight_update()  # connection 1 closes under it: sent again on connection 2
            assert fake.answered == [
                (1, b"POST /init_weights_update_group HTTP/1.1"),
                (2, b"POST /begin_weight_update HTTP/1.1"),
            ]
            assert fake.connections == 2

    run(body())


def test_the_resend_on_a_closed_connection_happens_once():
    async def body():
        fake = ClosingServer(close_every=True)
        async with await fake.start(), InferenceClient([fake.address], max_retries=0) as client:
            with pytest.raises(InferenceError, match="ServerDisconnectedError"):
                await client.begin_weight_update()
            assert fake.connections == 2 and fake.answered == []

    run(body())
