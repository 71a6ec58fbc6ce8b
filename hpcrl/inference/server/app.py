"""The CPU server's HTTP routes: the subset of SGLang's API that hpcrl uses (see sglang-http-api.md)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from aiohttp import web

from hpcrl.inference.server.protocol import parse_generate, response
from hpcrl.inference.server.runner import ModelRunner
from hpcrl.inference.server.sampling import RequestError
from hpcrl.inference.server.scheduler import Scheduler, Sequence
from hpcrl.inference.weight_group import close_weight_group, open_weight_group, receive_tensors

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 << 20
PAUSE_MODES = ("abort", "in_place", "retract")


class Server:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler):
        self.runner, self.scheduler = runner, scheduler
        self.groups: dict[str, Any] = {}
        self.loop_task: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_as_json])
        get, post = web.get, web.post
        app.add_routes(
            [
                get("/health", self.health),
                get("/model_info", self.model_info),
                get("/get_model_info", self.model_info),
                post("/generate", self.generate),
                post("/update_weights_from_disk", self.update_from_disk),
                post("/init_weights_update_group", self.init_group),
                post("/update_weights_from_distributed", self.update_from_distributed),
                post("/destroy_weights_update_group", self.destroy_group),
                get("/flush_cache", self.flush_cache),
                post("/flush_cache", self.flush_cache),
                post("/pause_generation", self.pause),
                post("/continue_generation", self.resume),
                post("/abort_request", self.abort),
            ]
        )
        app.on_startup.append(self._start_loop)
        app.on_cleanup.append(self._stop_loop)
        return app

    async def _start_loop(self, _: web.Application) -> None:
        self.loop_task = asyncio.create_task(self.scheduler.run_forever(), name="scheduler")

    async def _stop_loop(self, _: web.Application) -> None:
        if self.loop_task:
            self.loop_task.cancel()

    async def health(self, _: web.Request) -> web.Response:
        alive = self.loop_task is not None and not self.loop_task.done()
        return web.Response(status=200 if alive else 503)

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.runner.model_path,
                "tokenizer_path": self.runner.model_path,
                "is_generation": True,
                "weight_version": self.scheduler.weight_version,
                "preferred_sampling_params": None,
            }
        )

    async def generate(self, request: web.Request) -> web.Response:
        prompts, single = parse_generate(await _json(request), self._tokenize, self.runner.vocab_size)
        loop = asyncio.get_running_loop()
        pairs = []
        for p in prompts:
            for k in range(p.params.n):
                rid = p.rid if p.params.n == 1 else f"{p.rid}-{k}"
                pairs.append((Sequence(rid, p.input_ids, p.params, loop.create_future()), p))
        await self.scheduler.generate([seq for seq, _ in pairs])
        decode = self.runner.tokenizer.decode
        out = [response(s, p, decode(s.output_ids, skip_special_tokens=p.params.skip_special_tokens)) for s, p in pairs]
        return web.json_response(out[0] if single else out)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        path = _field(body, "model_path", str)
        if body.get("abort_all_requests"):
            self.scheduler.abort()
        try:
            await self.scheduler.update_weights(lambda: self.runner.load_weights_from_disk(path), _version(body))
        except (OSError, KeyError, ValueError) as e:
            return web.json_response({"success": False, "message": f"failed to load {path}: {e}"}, status=400)
        log.info("loaded weights version %s from %s", self.scheduler.weight_version, path)
        return web.json_response({"success": True, "message": f"loaded {path}", "num_paused_requests": 0})

    async def init_group(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name = body.get("group_name", "weight_update_group")
        args = (_field(body, "master_address", str), _field(body, "master_port", int))
        rank, world = _field(body, "rank_offset", int), _field(body, "world_size", int)
        backend = body.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # the CPU server has no GPU; gloo moves the same bytes
        self.groups[name] = await asyncio.to_thread(open_weight_group, *args, rank, world, name, backend)
        return web.json_response({"success": True, "message": f"joined {name} as rank {rank} of {world}"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json(request)
        group = self._group(body)
        names, dtypes, shapes = (_field(body, k, list) for k in ("names", "dtypes", "shapes"))
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError("names, dtypes and shapes must have the same length")
        specs = [(n, _dtype(d), list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        tensors = await asyncio.to_thread(receive_tensors, group, specs)
        await self.scheduler.update_weights(lambda: self.runner.load_tensors(tensors), _version(body))
        return web.json_response({"success": True, "message": f"updated {len(tensors)} tensors"})

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await _json(request)
        group = self._group(body)
        self.groups.pop(body.get("group_name", "weight_update_group"))
        await asyncio.to_thread(close_weight_group, group)
        return web.json_response({"success": True, "message": "destroyed"})

    async def flush_cache(self, _: web.Request) -> web.Response:
        # no prefix cache is kept across requests, so there is nothing to flush
        return web.Response(text="Cache flushed.\n")

    async def pause(self, request: web.Request) -> web.Response:
        body = await _json(request, default={})
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self.scheduler.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, _: web.Request) -> web.Response:
        await self.scheduler.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        body = await _json(request)
        rid = None if body.get("abort_all") else _field(body, "rid", str)
        return web.json_response({"aborted": self.scheduler.abort(rid)})

    def _tokenize(self, text: str) -> list[int]:
        return self.runner.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _group(self, body: dict) -> Any:
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            raise RequestError(f"no weights update group {name!r}; call /init_weights_update_group first")
        return self.groups[name]


@web.middleware
async def _errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        log.warning("%s %s: %s", request.method, request.path, e)
        return web.json_response({"error": {"message": str(e)}}, status=400)


async def _json(request: web.Request, default: Any = None) -> Any:
    if not request.can_read_body:
        if default is not None:
            return default
        raise RequestError("the body must be a JSON object")
    try:
        return await request.json()
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None


def _field(body: Any, name: str, kind: type) -> Any:
    if not isinstance(body, dict) or not isinstance(body.get(name), kind) or isinstance(body.get(name), bool):
        raise RequestError(f"field {name!r} must be a {kind.__name__}")
    return body[name]


def _version(body: dict) -> str | None:
    version = body.get("weight_version")
    return None if version is None else str(version)


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RequestError(f"unknown dtype {name!r}; expected a torch dtype name such as bfloat16")
    return dtype
