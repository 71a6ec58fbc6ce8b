"""Start inference servers (hpcrl's CPU server or SGLang) as child processes and wait until they serve.

Both backends start the same way: an argv from ``commands.server_command``, a child process with its
own log file, and a health wait with a deadline that fails at once, with the exit code and the log's
tail, when a server process dies (a missing SGLang install, a bad model path, an out-of-memory kill).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config.schema import InferenceConfig, LoRAConfig
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.commands import server_command
from hpcrl.inference.sglang import sglang_env
from hpcrl.launch.process import Child, spawn, stop_all
from hpcrl.net import format_hostport


@dataclass
class ServerProcess:
    child: Child
    address: str  # host:port the controller dials (the advertised address, not the bind address)


def start_server(
    backend: str,
    model_path: str | Path,
    *,
    bind_host: str,
    advertise_host: str,
    port: int,
    log_file: Path,
    inference: InferenceConfig,
    tp_size: int = 1,
    dtype: str = "float32",
    seed: int = 0,
    rank: int = 0,
    env: dict[str, str] | None = None,
    nccl_port: int | None = None,
    lora: LoRAConfig | None = None,
    is_embedding: bool = False,
    name: str = "server",
) -> ServerProcess:
    """Spawn one server; it is not ready until ``wait_ready`` returns. ``nccl_port``: SGLang's ``--nccl-port``;
    ``lora``: ``train.lora`` (a rank above 0 makes it serve adapters); ``is_embedding``: a discriminative reward
    model's server; ``name``: its role, as the process's errors name it."""
    cmd = server_command(
        backend,
        model_path,
        bind_host,
        port,
        tp_size=tp_size,
        inference=inference,
        dtype=dtype,
        seed=seed,
        nccl_port=nccl_port,
        lora=lora,
        is_embedding=is_embedding,
    )
    child_env = {**(env or {}), "HPCRL_RANK": str(rank)}
    if backend == "sglang":
        child_env = sglang_env({**os.environ, **child_env}, bind_host=bind_host)
    child = spawn(f"{name} {rank}", cmd, log_file, env=child_env)
    return ServerProcess(child, format_hostport(advertise_host, port))


async def wait_ready(servers: Sequence[ServerProcess], timeout_s: float, poll_s: float = 1.0) -> None:
    """Wait until every server answers /health; fail at once if any server process exits."""

    def check_alive() -> None:
        for server in servers:
            server.child.check_alive()

    async with InferenceClient([s.address for s in servers]) as client:
        await client.wait_healthy(timeout_s, check_alive=check_alive, poll_s=poll_s)


def stop_servers(servers: Sequence[ServerProcess], grace_s: float = 10.0) -> None:
    stop_all([s.child for s in servers], grace_s)
