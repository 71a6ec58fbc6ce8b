"""The CPU server's weight-update endpoints, with SGLang 0.5.23's contract, status codes and messages.

    /update_weights_from_disk         load a Hugging Face directory (no session needed)
    /init_weights_update_group        every tensor-parallel rank joins: rank_offset + tp_rank of world_size
    /begin_weight_update              open the session; 400 if one is open
    /update_weights_from_distributed  only inside the session (else 400): every rank allocates a buffer per
                                      tensor of the call, receives them in order, rank 0 loads them
    /end_weight_update                close the session; 400 if none is open
    /destroy_weights_update_group     leave the group on every rank
    /update_weight_version            only the version requests report (after a LoRA adapter's load, say);
                                      aborts every request first unless ``abort_all_requests`` is false

An answer is ``{"success", "message"}``, 200 or 400. With ``flush_cache`` (the default) an update fails
when requests are still running or queued (paused ones excepted), as SGLang's does: its cache flush is
refused then. Bodies are checked against SGLang's request classes (``requests.py``).
Each distributed call's receive buffers are counted: ``/model_info`` reports the bytes of the last call
and the largest call on each rank, the memory a GPU server would need on top of its weights.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from hpcrl.inference.server import requests
from hpcrl.inference.server.requests import read_body
from hpcrl.inference.server.runner import ModelRunner
from hpcrl.inference.server.sampling import RequestError
from hpcrl.inference.server.scheduler import Scheduler
from hpcrl.inference.server.tp_rank import digest
from hpcrl.inference.server.tp_ranks import TpRanks
from hpcrl.inference.weight_group import (
    DEFAULT_GROUP,
    DEFAULT_TIMEOUT_S,
    close_weight_group,
    dtype_of,
    open_weight_group,
    receive_tensors,
)

log = logging.getLogger(__name__)

SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)


class WeightUpdates:
    """The weight-update groups, the session and the receive-buffer counts of one server."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tp: TpRanks):
        self.runner, self.scheduler, self.tp = runner, scheduler, tp
        self.groups: dict[str, Any] = {}  # rank 0's membership, by group name
        self.session: str | None = None  # the selector of the open session
        self.last_call_bytes = 0  # receive buffers of the last /update_weights_from_distributed, on each rank
        self.max_call_bytes = 0  # the largest call's, since start
        self.calls = 0
        self.joined: dict[str, dict[str, Any]] = {}  # group name -> this server's ranks in it and its world size
        self._ranks = asyncio.Lock()  # one command at a time goes to the tensor-parallel ranks

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/update_weights_from_disk", self.update_from_disk),
            web.post("/init_weights_update_group", self.init_group),
            web.post("/begin_weight_update", self.begin),
            web.post("/update_weights_from_distributed", self.update_from_distributed),
            web.post("/end_weight_update", self.end),
            web.post("/destroy_weights_update_group", self.destroy_group),
            web.post("/update_weight_version", self.update_version),
            web.get("/get_weights_by_name", self.weights_by_name),
            web.post("/get_weights_by_name", self.weights_by_name),
        ]

    def info(self) -> dict[str, Any]:
        """For /model_info: the tensor-parallel size and each rank's receive buffers per call."""
        return {
            "tp_size": self.tp.tp_size,
            "weight_update_calls": self.calls,
            "weight_update_last_call_bytes": self.last_call_bytes,
            "weight_update_max_call_bytes": self.max_call_bytes,
            "weight_update_groups": self.joined,
        }

    async def update_from_disk(self, request: web.Request) -> web.Response:
        """Load ``model_path``'s ``*.safetensors`` (only those: SGLang's loader reads no config or tokenizer file
        there). Unpaused, SGLang loads under its model-update lock, a writer-preferring lock every request holds
        from its tokenizing to its answer: the load waits for the running requests (``abort_all_requests`` ends
        them first) and holds new ones until it is done, so its scheduler is empty at the cache flush and the
        flush is never refused. Here the requests that arrive meanwhile wait in the queue (no batch starts
        while an update waits) and run after it, on the new weights; they do not count against the flush."""
        body = await read_body(request, requests.DISK)
        path = field(body, "model_path", str)
        missing = missing_weights(path)
        if missing:
            return answer(False, f"Failed to get weights iterator: {missing}.", num_paused_requests=0)
        locked = self.scheduler.pause_mode is None  # SGLang's update takes the model-update lock when unpaused
        if body.get("abort_all_requests"):
            self.scheduler.abort()
        try:
            await self.scheduler.update_weights(lambda: self.runner.load_weights_from_disk(path), _version(body))
        except (OSError, KeyError, ValueError) as e:
            return answer(False, f"Failed to update model weights from {path}: {e}", num_paused_requests=0)
        log.info("loaded weights version %s from %s", self.scheduler.weight_version, path)
        return self._after_update(body, "Succeeded to update model weights.", locked=locked, num_paused_requests=0)

    async def init_group(self, request: web.Request) -> web.Response:
        body = await read_body(request, requests.INIT_GROUP)
        address, port = field(body, "master_address", str), field(body, "master_port", int)
        offset, world = field(body, "rank_offset", int), field(body, "world_size", int)
        name, backend = body.get("group_name", DEFAULT_GROUP), body.get("backend", "nccl")
        refused = self._refuse_group(name, backend, offset, world)
        if refused:
            return answer(False, f"Failed to initialize custom process group: {refused}.")
        log.info(
            "joining %s at %s:%d as ranks %d..%d of %d",
            name,
            address,
            port,
            offset,
            offset + self.tp.tp_size - 1,
            world,
        )
        join = {"op": "init", "master_address": address, "master_port": port, "world_size": world}
        join |= {"group_name": name, "backend": backend, "timeout_s": DEFAULT_TIMEOUT_S}
        async with self._ranks:
            self.tp.send([{**join, "rank": offset + k} for k in range(1, self.tp.tp_size)])
            own = asyncio.to_thread(open_weight_group, address, port, offset, world, name, backend, DEFAULT_TIMEOUT_S)
            group, others = await asyncio.gather(own, asyncio.to_thread(self.tp.collect), return_exceptions=True)
        failed = [str(group)] if isinstance(group, BaseException) else []
        failed += _errors(others)
        if failed:
            return answer(False, f"Failed to initialize custom process group: {'; '.join(failed)}.")
        self.groups[name] = group
        self.joined[name] = {"ranks": list(range(offset, offset + self.tp.tp_size)), "world_size": world}
        return answer(True, "Succeeded to initialize custom process group.")

    async def begin(self, request: web.Request) -> web.Response:
        body = await read_body(request, requests.BEGIN)
        selector = body.get("selector", "all")
        if self.session is not None:
            return answer(False, "a weight-update session is already open; call end_weight_update() first")
        self.session = selector
        return answer(True, "Success")

    async def end(self, request: web.Request) -> web.Response:
        await read_body(request, requests.END)
        if self.session is None:
            return answer(False, "no weight-update session is open; call begin_weight_update() first")
        self.session = None
        return answer(True, "Success")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_body(request, requests.UPDATE_DISTRIBUTED)
        names, dtypes, shapes = (field(body, k, list) for k in ("names", "dtypes", "shapes"))
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError(
                f"names, dtypes and shapes must have one entry per tensor, got {len(names)}, "
                f"{len(dtypes)} and {len(shapes)}"
            )
        if self.session is None:
            return answer(
                False, "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        name = body.get("group_name", DEFAULT_GROUP)
        if name not in self.groups:
            return answer(
                False,
                f"Failed to receive weights: Group {name} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first.",
            )
        try:
            specs = [(n, dtype_of(d), list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        except ValueError as e:
            return answer(False, f"Failed to receive weights: {e}")
        if body.get("abort_all_requests"):
            self.scheduler.abort()
        tensors, error = await self._receive(
            name, specs, [[n, d, list(s)] for n, d, s in zip(names, dtypes, shapes, strict=True)]
        )
        if error:
            return answer(False, f"Failed to receive weights: {error}")
        try:
            await self.scheduler.update_weights(lambda: self.runner.load_tensors(tensors), _version(body))
        except (KeyError, ValueError) as e:
            message = f"Failed to update parameter online: {e}. The full weights of the ModelRunner are partially "
            return answer(False, message + "updated. Please discard the whole weights.")
        return self._after_update(body, "Succeeded to update parameter online.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await read_body(request, requests.DESTROY_GROUP)
        name = body.get("group_name", DEFAULT_GROUP)
        if name not in self.groups:
            return answer(False, "The group to be destroyed does not exist.")
        group = self.groups.pop(name)
        self.joined.pop(name, None)
        async with self._ranks:
            self.tp.send([{"op": "destroy", "group_name": name}] * (self.tp.tp_size - 1))
            closing = asyncio.to_thread(close_weight_group, group)
            _, others = await asyncio.gather(closing, asyncio.to_thread(self.tp.collect))
        failed = _errors(others)
        if failed:
            return answer(False, f"Failed to destroy custom process group: {'; '.join(failed)}.")
        return answer(True, "Succeeded to destroy custom process group.")

    async def update_version(self, request: web.Request) -> web.Response:
        """SGLang's ``update_weight_version``: ``abort_all_requests`` defaults to true there too."""
        body = await read_body(request, requests.WEIGHT_VERSION)
        version = field(body, "new_version", str)
        if body.get("abort_all_requests", True):
            self.scheduler.abort()
        self.scheduler.weight_version = version
        message = f"Weight version updated to {version}"
        return web.json_response({"success": True, "message": message, "new_version": version})

    async def weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's test endpoint: the first ``truncate_size`` rows of a parameter, as numbers."""
        body = await read_body(request, requests.WEIGHTS_BY_NAME)
        name, size = field(body, "name", str), body.get("truncate_size", 100)
        params = self.runner.parameter_specs()
        if name not in params:
            raise RequestError(f"Get parameter by name failed: the model has no parameter {name!r}")
        return web.json_response(params[name][:size].float().tolist())

    # ----------------------------------------------------------------------------------------------------
    def _refuse_group(self, name: str, backend: Any, offset: int, world: int) -> str:
        """Why this server cannot join as asked ("" when it can): checked before any rank waits for the others."""
        last = offset + self.tp.tp_size - 1
        if name in self.groups:
            return "The specified group name has already been created, please use a different group name"
        if backend not in ("gloo", "nccl"):
            return f"backend must be nccl or gloo, got {backend!r}"
        if backend == "nccl" and not torch.cuda.is_available():
            return (
                "backend nccl needs CUDA, and hpcrl's CPU server runs on none; trainers on CPUs send over gloo "
                "(a trainer on GPUs cannot push to a CPU server)"
            )
        if offset < 1 or last >= world:
            return (
                f"this server's ranks rank_offset + tp_rank = {offset}..{last} (tp_size {self.tp.tp_size}) are not "
                f"within 1..{world - 1} (rank 0 is the trainer, world_size {world})"
            )
        return ""

    async def _receive(self, name: str, specs: list, wire: list) -> tuple[dict[str, torch.Tensor], str]:
        """Every rank receives the call's tensors; (rank 0's tensors, "" or what went wrong)."""
        async with self._ranks:
            self.tp.send([{"op": "receive", "group_name": name, "specs": wire}] * (self.tp.tp_size - 1))
            own = asyncio.to_thread(receive_tensors, self.groups[name], specs)
            tensors, others = await asyncio.gather(own, asyncio.to_thread(self.tp.collect), return_exceptions=True)
        if isinstance(tensors, BaseException):
            return {}, f"{type(tensors).__name__}: {tensors}"
        failed = _errors(others)
        if failed:
            return {}, "; ".join(failed)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.calls += 1
        self.last_call_bytes, self.max_call_bytes = nbytes, max(self.max_call_bytes, nbytes)
        log.info(
            "received %d tensors (%.1f MB of receive buffers on each of %d ranks)",
            len(tensors),
            nbytes / 1e6,
            self.tp.tp_size,
        )
        if others:
            mine = [digest(t) for t in tensors.values()]
            for k, other in enumerate(others, start=1):
                differ = [n for n, a, b in zip(tensors, mine, other["digests"], strict=True) if a != b]
                if differ:
                    return {}, f"tp rank {k} received other bytes than tp rank 0 for {differ[:5]}"
        return tensors, ""

    def _after_update(self, body: dict[str, Any], message: str, *, locked: bool = False, **extra: Any) -> web.Response:
        """The answer after a load; ``locked``: SGLang held every request off during it (see update_from_disk)."""
        if body.get("flush_cache", True) and not locked and not self.scheduler.idle():
            return answer(False, NOT_FLUSHED, **extra)
        version = body.get("weight_version")
        if version is not None:
            message += f" Weight version updated to {version}."
        return answer(True, message, **extra)


def answer(success: bool, message: str, **extra: Any) -> web.Response:
    if not success:
        log.warning("%s", message)
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def missing_weights(path: str) -> str:
    """Why SGLang's loader would find no weights to load in ``path`` ("" when it would): no directory (SGLang
    would look for a model of that name on the Hugging Face hub), no ``*.safetensors`` file, or an index
    (``model.safetensors.index.json``) naming shard files that are not there."""
    folder = Path(path)
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        return f"Cannot find any model weights with `{path}`"
    index = folder / SAFE_WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return f"{SAFE_WEIGHTS_INDEX} in {path} cannot be read: {e}"
        absent = sorted(name for name in shards if not (folder / name).is_file())
        if absent:
            return (
                f"{SAFE_WEIGHTS_INDEX} references {len(absent)} shard file(s) missing from {path} "
                f"(incomplete download?): {absent}"
            )
    return ""


def field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RequestError(f"field {name!r} must be a {kind.__name__}")
    return value


def _version(body: dict[str, Any]) -> str | None:
    version = body.get("weight_version")
    return None if version is None else str(version)


def _errors(answers: Any) -> list[str]:
    if isinstance(answers, BaseException):
        return [f"{type(answers).__name__}: {answers}"]
    return [f"tp rank {k}: {a.get('error')}" for k, a in enumerate(answers, start=1) if not a.get("ok")]
