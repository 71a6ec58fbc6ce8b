"""A small SGLang-like HTTP server on a real socket, for tests of the inference client's logic.

It answers the subset of SGLang's API the client uses, records every request, and misbehaves on demand
(HTTP errors, never answering, holding a request until released). Tests of the real protocol run against
hpcrl's CPU server instead. This module holds no tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from aiohttp import web

from hpcrl.net import format_hostport

HOLD = "hold"  # a generate request with this rid waits until release is set


class FakeServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.address = ""
        self.requests: list[tuple[str, Any]] = []  # (path, JSON body or None), in arrival order
        self.calls: list[tuple[str, str, Any]] = []  # (method, path, JSON body or None: no body), the same
        self.fail_next: list[int] = []  # HTTP statuses to answer the next requests with (any path but /health)
        self.health_status = 200
        self.hang = False  # /generate never answers
        self.delay_s = 0.0  # every answer but /health's comes this late
        self.finish_reason: dict[str, Any] = {"type": "length"}
        self.logprob_shift = 0  # answer logprobs for token ids shifted by this much (a broken server)
        self.success = True  # what the weight endpoints report
        self.barrier: asyncio.Barrier | None = None  # /init_weights_update_group waits here, like a process group
        self.weight_version = "3"
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded: name -> path ("__tensor__" from tensors)
        self.release = asyncio.Event()
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        self.address = format_hostport(self.host, sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        self._stopping.set()
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == "/health":
            self.requests.append((path, None))
            self.calls.append((request.method, path, await request.json() if request.can_read_body else None))
            return web.Response(status=self.health_status)
        body = await request.json() if request.can_read_body else None
        self.requests.append((path, body))
        self.calls.append((request.method, path, body))
        await asyncio.sleep(self.delay_s)
        if self.fail_next:
            status = self.fail_next.pop(0)
            return web.Response(status=status, text=f"fake error {status} on {path}")
        if path == "/generate":
            return await self._generate(body)
        if path == "/init_weights_update_group" and self.barrier is not None:
            await asyncio.wait_for(self.barrier.wait(), timeout=2.0)
        if path == "/model_info":
            return web.json_response({"model_path": "/fake/model", "weight_version": self.weight_version})
        if path == "/flush_cache":
            return web.Response(text="Cache flushed.")
        if path in ("/pause_generation", "/continue_generation"):
            return web.json_response({"message": "ok", "status": "ok"})
        if "lora" in path:
            return self._lora(path, body)
        if path == "/update_weight_version" and self.success:
            self.weight_version = body["new_version"]
        return web.json_response({"success": self.success, "message": f"fake {path} success={self.success}"})

    def _lora(self, path: str, body: dict[str, Any]) -> web.Response:
        """SGLang's LoRAUpdateOutput: 200 with the adapters loaded now, or 400 with the reason."""
        if not self.success:
            answer = {"success": False, "error_message": f"fake {path} refused {body['lora_name']}"}
            return web.json_response({**answer, "loaded_adapters": None}, status=400)
        if path == "/unload_lora_adapter":
            self.adapters.pop(body["lora_name"], None)
        else:
            self.adapters[body["lora_name"]] = body.get("lora_path", "__tensor__")
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)})

    async def _generate(self, body: dict[str, Any]) -> web.Response:
        if self.hang:
            await self._stopping.wait()
        if body.get("rid") == HOLD:
            await self.release.wait()
        prompts = body["input_ids"]
        batch = isinstance(prompts[0], list)
        params = body["sampling_params"]  # one dict for all prompts, or one per prompt
        per_prompt = params if isinstance(params, list) else [params] * (len(prompts) if batch else 1)
        answers = [
            self._answer(ids, p, body) for ids, p in zip(prompts if batch else [prompts], per_prompt, strict=True)
        ]
        return web.json_response(answers if batch else answers[0])

    def _answer(self, input_ids: list[int], params: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        n = params["max_new_tokens"]
        output_ids = [input_ids[-1] + 1 + i for i in range(n)]
        meta: dict[str, Any] = {
            "id": body.get("rid") or "r",
            "finish_reason": {**self.finish_reason, "length": n},
            "prompt_tokens": len(input_ids),
            "completion_tokens": n,
            "weight_version": self.weight_version,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [
                [-0.5 * (i + 1), t + self.logprob_shift, None] for i, t in enumerate(output_ids)
            ]
        return {"text": "", "output_ids": output_ids, "meta_info": meta}


@contextlib.asynccontextmanager
async def fake_servers(n: int, host: str = "127.0.0.1") -> AsyncIterator[list[FakeServer]]:
    async with started([FakeServer(host) for _ in range(n)]) as servers:
        yield servers


@contextlib.asynccontextmanager
async def started(servers: list[Any]) -> AsyncIterator[list[Any]]:
    """``servers`` (each with async ``start`` and ``stop``) started, and stopped at the end."""
    try:
        for server in servers:
            await server.start()
        yield servers
    finally:
        for server in servers:
            await server.stop()


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> Any:
    """Run a test coroutine; the bound turns a hang into a failure instead of a stuck test run."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def closed_port_address() -> str:
    """host:port where nothing listens (a port just released by the kernel)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return format_hostport("127.0.0.1", sock.getsockname()[1])


async def wait_for_requests(servers: list[FakeServer], path: str, count: int) -> None:
    while sum(len(s.bodies(path)) for s in servers) < count:
        await asyncio.sleep(0.01)
