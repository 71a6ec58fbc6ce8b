"""A small reward-model server on a real socket, answering SGLang's ``/generate`` (text) and ``/classify`` as the CPU
server does, recording every body, and misbehaving on demand. Tests of the real model use the CPU server. This module
holds no tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from hpcrl.net import format_hostport
from tests.inference.test_client_fakes import started


class FakeRewardModel:
    """``/generate``: "Y" for a text ending in "ok", else "N"; ``/classify``: the text's length, as its one score."""

    def __init__(self) -> None:
        self.address = ""
        self.bodies: list[tuple[str, Any]] = []  # (path, JSON body), in arrival order
        self.status = 200  # anything else: every answer is this status with an SGLang-like error body
        self.hang = False  # never answer
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.address = format_hostport("127.0.0.1", sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append((request.path, body))
        if self.hang:
            await self._stopping.wait()
        if self.status != 200:
            return web.json_response({"error": {"message": f"fake refusal of {request.path}"}}, status=self.status)
        texts = body["text"]
        if request.path == "/generate":
            answers = [{"text": "Y" if t.endswith("ok") else "N", "output_ids": [1], "meta_info": {}} for t in texts]
        else:
            answers = [{"embedding": [float(len(t))], "meta_info": {}} for t in texts]
        return web.json_response(answers)


@contextlib.asynccontextmanager
async def fake_reward_models(n: int) -> AsyncIterator[list[FakeRewardModel]]:
    async with started([FakeRewardModel() for _ in range(n)]) as servers:
        yield servers
