"""Weight sync with LoRA (``train.lora.rank`` > 0): after a train step the servers get the policy's new adapter, not
the model. The servers run with SGLang's LoRA options (``hpcrl.inference.sglang.lora_args``) and hold the adapter
under one name, ``POLICY_ADAPTER``, which every generate request names (the client's ``adapter``).

A push: generation is paused (``abort``: running requests come back with what they have, and the workflow
resubmits them once ``resumed`` is set, as for full weights); every server unloads the adapter it holds and loads
the new one under the same name; its weight version is set to the new version (``/update_weight_version``: loading
an adapter does not change it, and every token's version, hence staleness, is read from it); generation continues.
Requests sent meanwhile wait in SGLang until it continues, and only then resolve the adapter's name, so none of
them meets the name unloaded. By ``train.weight_sync``:

- ``disk``: the step's train call (or a call of its own) has trainer rank 0 write the adapter in PEFT's layout under
  the run directory (``export_path``, as for full weights); ``/load_lora_adapter`` reads it there. Older exports are
  deleted once the servers hold the new one.
- ``distributed``: the adapter's tensors come from the trainers over RPC (``lora_adapter``) and go to each server in
  the body of ``/load_lora_adapter_from_tensors``, in the servers' dtype, one copy per tensor-parallel rank. SGLang
  0.5.23 has no collective path for adapters, so no weight-update group is formed: an adapter is megabytes where a
  model is gigabytes, and it crosses nodes over HTTP.

``setup`` loads version 0 (the adapter as initialised: PEFT's lora_B is zero, so it generates as the base model)
before any request names it. A restarted server (``ServerPool``) loads the current adapter with ``load_current``.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

from hpcrl.inference.client import InferenceClient
from hpcrl.inference.options import POLICY_ADAPTER

log = logging.getLogger(__name__)


class AdapterSync:
    def __init__(
        self,
        mode: str,
        client: InferenceClient,
        trainers,
        resumed: asyncio.Event,
        weights_dir: Path,
        *,
        dtype: str = "float32",  # the servers' dtype: the tensors a distributed push sends
    ):
        self.mode, self.client, self.trainers, self.resumed = mode, client, trainers, resumed
        self.weights_dir, self.dtype = weights_dir, dtype
        self.episodes: Any = None  # rollout.remote.RemoteEpisodes when rollout workers run the episodes
        self.lock = asyncio.Lock()  # held by a push, and by a restarted server loading ``current``
        self.current: tuple[Any, int] | None = None  # the adapter the servers hold (a path, or config and tensors)
        self.cleanup: asyncio.Task | None = None  # disk: the older exports' deletion, after the last push

    async def setup(self) -> None:
        """The initial adapter (version 0) on every server, before any request names it."""
        await self.push(0)

    async def export_path(self, version: int) -> str:
        """Disk: where the train call that makes ``version`` writes the adapter; distributed: "" (sent in the body)."""
        if self.mode != "disk":
            return ""
        await self._cleaned()
        return str(self._path(version))

    async def push(self, version: int, *, exported: bool = False) -> None:
        """The servers get ``version``'s adapter; ``exported``: the trainers already wrote it to ``export_path``."""
        async with self.lock:
            await self._cleaned()
            source = await self._source(version, exported)
            self.resumed.clear()
            if self.episodes is not None:  # rollout workers hold their resubmissions until the servers resume
                await self.episodes.pause()
            try:
                await self.client.pause("abort")
                try:
                    if self.current is not None:
                        await self.client.unload_lora_adapter(POLICY_ADAPTER)
                    await self._load(source, version, None)
                    self.current = (source, version)
                finally:
                    await self.client.resume()
            finally:
                if self.episodes is not None:
                    await self.episodes.resume()
                self.resumed.set()
            if self.mode == "disk":  # in a thread, while the run goes on: awaited by the next push or close()
                self.cleanup = asyncio.create_task(asyncio.to_thread(self._drop_older, Path(source)))

    async def load_current(self, servers: list[str]) -> int | None:
        """A restarted server (it holds no adapter) loads the current one; called under ``lock``. Its version."""
        if self.current is None:
            return None
        source, version = self.current
        await self._load(source, version, servers)
        return version

    async def _source(self, version: int, exported: bool) -> Any:
        """What the servers load: the adapter's directory (disk), or its config and tensors (distributed)."""
        if self.mode == "disk":
            path = self._path(version)
            if not exported:  # else a missing export fails the servers' load, which names the path
                await self.trainers.export_for_servers(path)
            return str(path)
        config, tensors = await self.trainers.lora_adapter()
        return config, await asyncio.to_thread(_as_dtype, tensors, self.dtype)

    async def _load(self, source: Any, version: int, servers: list[str] | None) -> None:
        if self.mode == "disk":
            await self.client.load_lora_adapter(POLICY_ADAPTER, source, servers=servers)
        else:
            config, tensors = source
            await self.client.load_lora_adapter_from_tensors(POLICY_ADAPTER, config, tensors, servers=servers)
        await self.client.update_weight_version(version, servers=servers)

    def _path(self, version: int) -> Path:
        return self.weights_dir / f"v{version:06d}"

    def _drop_older(self, path: Path) -> None:
        """The servers hold ``path``: the older exports go, those of an interrupted earlier run too."""
        for old in self.weights_dir.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    async def _cleaned(self) -> None:
        if self.cleanup is not None:
            await self.cleanup
            self.cleanup = None

    async def close(self) -> None:
        await self._cleaned()


def _as_dtype(tensors: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The adapter's tensors in the servers' dtype (the trainers hold float32): SGLang casts them to it anyway."""
    import torch

    target = getattr(torch, dtype)
    return {name: tensor.to(target) for name, tensor in tensors.items()}
