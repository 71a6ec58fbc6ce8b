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
from pathlib import Path
from typing import Any

from hpcrl.controller.weights import WeightSync
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.options import POLICY_ADAPTER


class AdapterSync(WeightSync):
    """``WeightSync``'s push (its lock, the workflows held meanwhile, the older exports' deletion) with an adapter
    for the weights: ``_source`` and ``_send`` are the module docstring's."""

    def __init__(self, mode: str, client: InferenceClient, trainers, resumed: asyncio.Event, weights_dir: Path, *,
                 dtype: str = "float32"):  # fmt: skip
        super().__init__(mode, client, trainers, resumed, weights_dir, dtype=dtype)
        self.loaded: tuple[Any, int] | None = None  # the adapter the servers hold (a path, or config and tensors)

    async def setup(self) -> None:
        """The initial adapter (version 0) on every server, before any request names it."""
        await self.push(0)

    async def load_current(self, servers: list[str]) -> int | None:
        """A restarted server (it holds no adapter) loads the current one; called under ``lock``. Its version."""
        if self.loaded is None:
            return None
        source, version = self.loaded
        await self._load(source, version, servers)
        return version

    async def _source(self, version: int, exported: bool) -> Any:
        """What the servers load: the adapter's directory (disk), or its config and tensors (distributed)."""
        if self.mode == "disk":
            return await self._export(version, exported)
        config, tensors = await self.trainers.lora_adapter()
        return config, await asyncio.to_thread(_as_dtype, tensors, self.dtype)

    async def _send(self, source: Any, version: int) -> None:
        await self.client.pause("abort")
        try:
            if self.loaded is not None:
                await self.client.unload_lora_adapter(POLICY_ADAPTER)
            await self._load(source, version, None)
            self.loaded = (source, version)
        finally:
            await self.client.resume()

    async def _load(self, source: Any, version: int, servers: list[str] | None) -> None:
        if self.mode == "disk":
            await self.client.load_lora_adapter(POLICY_ADAPTER, str(source), servers=servers)
        else:
            config, tensors = source
            await self.client.load_lora_adapter_from_tensors(POLICY_ADAPTER, config, tensors, servers=servers)
        await self.client.update_weight_version(version, servers=servers)


def _as_dtype(tensors: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The adapter's tensors in the servers' dtype (the trainers hold float32): SGLang casts them to it anyway."""
    import torch

    target = getattr(torch, dtype)
    return {name: tensor.to(target) for name, tensor in tensors.items()}
