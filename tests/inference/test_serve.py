"""Starting servers, waiting for them, and losing them: real processes, real HTTP."""

import asyncio
import os
import signal
import time

import pytest

from hpcrl.config.schema import InferenceConfig
from hpcrl.inference.client import InferenceClient, InferenceError
from hpcrl.inference.serve import start_server, stop_servers, wait_ready
from hpcrl.launch.process import ChildExited
from tests.inference.conftest import free_port

PARAMS = {"max_new_tokens": 4, "temperature": 0}


def _start(backend, model, tmp_path, **kw):
    return start_server(
        backend,
        model,
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        port=free_port(),
        log_file=tmp_path / f"{backend}.log",
        inference=InferenceConfig(),
        **kw,
    )


def test_cpu_server_starts_serves_and_a_killed_one_fails_the_client_fast(tiny_model, tmp_path):
    servers = [_start("cpu", tiny_model, tmp_path, rank=r) for r in range(2)]
    try:
        asyncio.run(wait_ready(servers, timeout_s=180, poll_s=0.2))

        async def scenario():
            async with InferenceClient([s.address for s in servers], request_timeout_s=30, backoff_s=0.1) as client:
                results = await asyncio.gather(*(client.generate([5, 75, 6, 83], PARAMS) for _ in range(8)))
                assert {r.server for r in results} == {s.address for s in servers}
                os.kill(servers[0].child.pid, signal.SIGKILL)
                while servers[0].child.alive():
                    await asyncio.sleep(0.05)
                start = time.monotonic()
                with pytest.raises(InferenceError) as err:
                    await client.generate([5, 75, 6, 83], PARAMS, server=servers[0].address)
                assert time.monotonic() - start < 10
                assert servers[0].address in str(err.value)
                # the survivor still serves
                assert (await client.generate([5, 75], PARAMS, server=servers[1].address)).output_ids

        asyncio.run(scenario())
        start = time.monotonic()
        with pytest.raises(ChildExited, match="server 0"):
            asyncio.run(wait_ready(servers, timeout_s=600, poll_s=0.2))
        assert time.monotonic() - start < 10, "a dead server must fail the wait at once, not at its deadline"
    finally:
        stop_servers(servers, grace_s=5)


def test_sglang_path_fails_fast_when_sglang_cannot_start(tiny_model, tmp_path):
    """SGLang is not installed here: its process dies at once and the wait says so, with the log tail."""
    try:
        import sglang  # noqa: F401

        pytest.skip("sglang is installed: this checks the failure path of a machine without it")
    except ImportError:
        pass
    server = _start("sglang", tiny_model, tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(ChildExited) as err:
            asyncio.run(wait_ready([server], timeout_s=1200, poll_s=0.2))
        assert time.monotonic() - start < 60
        assert "No module named 'sglang'" in str(err.value)
    finally:
        stop_servers([server], grace_s=5)
