"""Weight sync: after a train step, the servers get the new weights, tagged with the new version.

Generation is paused in ``abort`` mode first: in-flight requests come back with what they have, and the
workflow resubmits them once generation resumes (``resumed`` is cleared before the pause and set after
the continue, so nothing is submitted in between). Then, by ``train.weight_sync``:

- ``disk``: trainer rank 0 exports the model (Hugging Face layout) under the run directory and every
  server loads it (``/update_weights_from_disk``);
- ``distributed``: trainer rank 0 and the servers formed a process group once at start
  (``/init_weights_update_group``); rank 0 broadcasts tensor by tensor while the servers receive
  (``/update_weights_from_distributed``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

from hpcrl.inference.client import InferenceClient

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, mode: str, client: InferenceClient, trainers, resumed: asyncio.Event, weights_dir: Path):
        self.mode, self.client, self.trainers, self.resumed = mode, client, trainers, resumed
        self.weights_dir = weights_dir
        self.specs: tuple[list[str], list[str], list[list[int]]] | None = None
        self.episodes: Any = None  # rollout.remote.RemoteEpisodes when rollout workers run the episodes
        self.lock = asyncio.Lock()  # held by a push, and by a restarted server loading ``current``
        self.current: tuple[str, int] | None = None  # disk: the newest export and its version (None: the initial)

    async def setup(self, master_address: str, master_port: int) -> None:
        """Form the weight-update group (distributed mode)."""
        world = self.client.weights_group_world_size()
        await asyncio.gather(
            self.client.init_weights_update_group(master_address, master_port, backend=self.trainers.weights_backend),
            self.trainers.join_weight_group(master_address, master_port, world),
        )
        self.specs = await self.trainers.weight_specs()
        log.info("weight-update group formed at %s:%d with %d servers", master_address, master_port, world - 1)

    async def push(self, version: int) -> None:
        async with self.lock:
            self.resumed.clear()
            if self.episodes is not None:  # rollout workers hold their resubmissions until the servers resume
                await self.episodes.pause()
            await self.client.pause("abort")
            try:
                if self.mode == "disk":
                    await self._push_disk(version)
                else:
                    await self._push_distributed(version)
            finally:
                await self.client.resume()
                if self.episodes is not None:
                    await self.episodes.resume()
                self.resumed.set()

    async def _push_disk(self, version: int) -> None:
        path = self.weights_dir / f"v{version:06d}"
        await self.trainers.export(path)
        self.current = (str(path), version)  # a server restarted from now on loads this one
        await self.client.update_weights_from_disk(str(path), version)
        # the servers hold the new export: the older ones go, those of an interrupted earlier run too
        for old in self.weights_dir.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    async def _push_distributed(self, version: int) -> None:
        assert self.specs is not None, "setup() forms the group first"
        names, dtypes, shapes = self.specs
        await asyncio.gather(
            self.client.update_weights_from_distributed(names, dtypes, shapes, version),
            self.trainers.push_weights(version),
        )

    async def close(self) -> None:
        if self.mode == "distributed" and self.specs is not None:
            await self.client.destroy_weights_update_group()
