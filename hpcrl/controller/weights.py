"""Weight sync: after a train step, the servers get the new weights, tagged with the new version.

Generation is paused in ``abort`` mode while the servers take the weights: in-flight requests come back
with what they have, and the workflow resubmits them once generation resumes (``resumed`` is cleared
before the pause and set after the continue, so nothing is submitted in between). By ``train.weight_sync``:

- ``disk``: trainer rank 0 exports the model (Hugging Face layout) under the run directory while the
  servers go on generating with the old weights (with ``rollout.max_staleness`` > 0 they have work); then
  generation is paused only for every server to load it (``/update_weights_from_disk``);
- ``distributed``: at start, trainer rank 0 starts the group's rendezvous on its own node with a port of
  its own slice and reports it (host, port, backend: nccl on CUDA, gloo on CPU), and every
  tensor-parallel rank of every server joins it (``/init_weights_update_group``, ``rank_offset + tp_rank``).
  Each push is one session per server: ``/begin_weight_update``, then one
  ``/update_weights_from_distributed`` per bucket of at most ``train.weight_sync_bucket_mb`` in the servers'
  dtype (while rank 0 broadcasts tensor by tensor), then ``/end_weight_update``.

Nothing about the rendezvous is chosen on the controller's host: on a cluster it is another node.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

from hpcrl.inference.client import InferenceClient
from hpcrl.inference.weight_layout import Spec, buckets, spec_bytes

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(
        self,
        mode: str,
        client: InferenceClient,
        trainers,
        resumed: asyncio.Event,
        weights_dir: Path,
        *,
        dtype: str = "float32",  # the servers' dtype: what a distributed push sends
        bucket_bytes: int = 512 << 20,  # the most bytes one /update_weights_from_distributed call receives
    ):
        self.mode, self.client, self.trainers, self.resumed = mode, client, trainers, resumed
        self.weights_dir = weights_dir
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.buckets: list[list[Spec]] | None = None  # distributed: the push's calls, once the group is formed
        self.episodes: Any = None  # rollout.remote.RemoteEpisodes when rollout workers run the episodes
        self.lock = asyncio.Lock()  # held by a push, and by a restarted server loading ``current``
        self.current: tuple[str, int] | None = None  # disk: the newest export and its version (None: the initial)

    async def setup(self) -> None:
        """Form the weight-update group (distributed mode): rank 0 hosts it, every server rank joins."""
        timeout_s = self.client.weight_update_timeout_s
        host, port, backend = await self.trainers.host_weight_group(timeout_s)
        world = self.client.weights_group_world_size()
        await asyncio.gather(
            self.client.init_weights_update_group(host, port, backend=backend),
            self.trainers.join_weight_group(world, timeout_s),
        )
        specs = await self.trainers.weight_specs(self.dtype)
        self.buckets = buckets(specs, self.bucket_bytes)
        log.info(
            "weight-update group formed at trainer rank 0's %s:%d (%s) with %d server ranks; a push is %d call(s) "
            "of at most %.0f MB (%s, %.1f MB in all)",
            *(host, port, backend, world - 1, len(self.buckets), self.bucket_bytes / 2**20, self.dtype),
            spec_bytes(specs) / 2**20,
        )

    async def push(self, version: int) -> None:
        async with self.lock:
            exported = await self._export(version) if self.mode == "disk" else None
            self.resumed.clear()
            if self.episodes is not None:  # rollout workers hold their resubmissions until the servers resume
                await self.episodes.pause()
            await self.client.pause("abort")
            try:
                if exported is not None:
                    await self._load(exported, version)
                else:
                    await self._push_distributed(version)
            finally:
                await self.client.resume()
                if self.episodes is not None:
                    await self.episodes.resume()
                self.resumed.set()

    async def _export(self, version: int) -> Path:
        path = self.weights_dir / f"v{version:06d}"
        await self.trainers.export(path)
        self.current = (str(path), version)  # a server restarted from now on loads this one
        return path

    async def _load(self, path: Path, version: int) -> None:
        await self.client.update_weights_from_disk(str(path), version)
        # the servers hold the new export: the older ones go, those of an interrupted earlier run too
        for old in self.weights_dir.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    async def _push_distributed(self, version: int) -> None:
        assert self.buckets is not None, "setup() forms the group first"
        await self.client.begin_weight_update()
        await asyncio.gather(self._send_buckets(version), self.trainers.push_weights(version, self.dtype))
        await self.client.end_weight_update()

    async def _send_buckets(self, version: int) -> None:
        """One call per bucket, in order: each answers once its tensors have arrived from rank 0's broadcasts."""
        assert self.buckets is not None
        for i, bucket in enumerate(self.buckets):
            names, dtypes, shapes = zip(*bucket, strict=True)
            last = i == len(self.buckets) - 1
            await self.client.update_weights_from_distributed(names, dtypes, shapes, version, flush_cache=last)

    async def close(self) -> None:
        if self.mode == "distributed" and self.buckets is not None:
            await self.client.destroy_weights_update_group()
