"""Weight sync: after a train step, the servers get the new weights, tagged with the new version.

In-flight requests are aborted while the servers take the weights: they come back with what they have, and
the workflow resubmits them once generation resumes (``resumed`` is cleared before the servers are told and
set once they have the weights, so nothing is submitted in between). By ``train.weight_sync``:

- ``disk``: trainer rank 0 writes the weights alone (one ``model.safetensors``, no config or tokenizer
  files: SGLang's loader reads only the ``*.safetensors`` of the directory) under the run directory while
  the servers go on generating with the old weights (with ``rollout.max_staleness`` > 0 they have work).
  The loop has the step's last train call write it (``export_path``, then ``push(exported=True)``): one
  round trip to the trainers less per step than a call of its own, which ``push`` makes otherwise. Then
  one call per server, ``/update_weights_from_disk`` with ``abort_all_requests``, aborts what runs and
  loads it. No pause and continue around it: SGLang loads under its model-update lock, which holds new
  requests until the load and the cache flush are done (its abort-mode pause would add two round trips,
  and polls every 1 s until the aborted requests have ended). The older exports are deleted in a thread
  once the servers hold the new one, while the run goes on;
- ``distributed``: generation is paused (``abort``) for the push and continued after it. At start, trainer
  rank 0 starts the group's rendezvous on its own node with a port of
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
        self.cleanup: asyncio.Task | None = None  # disk: the older exports' deletion, after the last push

    async def setup(self) -> None:
        """Form the weight-update group (distributed mode): rank 0 hosts it, every server rank joins."""
        if self.mode != "distributed":
            return
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

    async def export_path(self, version: int) -> str:
        """Disk mode: where the train call that makes ``version`` writes the servers' weights (``push`` with
        ``exported`` then loads them), once the older exports' deletion is over, so it cannot take the new one.
        Distributed mode: "" (the push sends the weights itself)."""
        if self.mode != "disk":
            return ""
        await self._cleaned()
        return str(self._path(version))

    async def push(self, version: int, *, exported: bool = False) -> None:
        """The servers get ``version``; ``exported``: the trainers already wrote it to ``export_path(version)``."""
        async with self.lock:
            await self._cleaned()
            source = await self._source(version, exported)
            self.resumed.clear()
            if self.episodes is not None:  # rollout workers hold their resubmissions until the servers resume
                await self.episodes.pause()
            try:
                await self._send(source, version)
            finally:
                if self.episodes is not None:
                    await self.episodes.resume()
                self.resumed.set()
            if self.mode == "disk":  # in a thread, while the run goes on: awaited by the next push or close()
                self.cleanup = asyncio.create_task(asyncio.to_thread(self._drop_older, Path(source)))

    async def _source(self, version: int, exported: bool) -> Any:
        """What the servers get, made while they go on generating: disk, the export's directory; else nothing."""
        return await self._export(version, exported) if self.mode == "disk" else None

    async def _send(self, source: Any, version: int) -> None:
        """The servers take ``version`` (generation closed to the workflows meanwhile)."""
        if self.mode == "disk":
            await self.client.update_weights_from_disk(str(source), version, abort_all_requests=True)
            return
        await self.client.pause("abort")
        try:
            await self._push_distributed(version)
        finally:
            await self.client.resume()

    async def load_current(self, servers: list[str]) -> int | None:
        """A restarted server loads the newest export (disk mode; called under ``lock``): its version, or None
        while the servers hold the initial weights (which it starts with)."""
        if self.current is None:
            return None
        path, version = self.current
        await self.client.update_weights_from_disk(path, version, servers=servers)
        return version

    def _path(self, version: int) -> Path:
        return self.weights_dir / f"v{version:06d}"

    async def _export(self, version: int, exported: bool) -> Path:
        path = self._path(version)
        if not exported:  # else a missing export fails the servers' load, which names the path
            await self.trainers.export_for_servers(path)
        self.current = (str(path), version)  # a server restarted from now on loads this one
        return path

    def _drop_older(self, path: Path) -> None:
        """The servers hold ``path``: the older exports go, those of an interrupted earlier run too."""
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

    async def _cleaned(self) -> None:
        if self.cleanup is not None:
            await self.cleanup
            self.cleanup = None

    async def close(self) -> None:
        await self._cleaned()
        if self.mode == "distributed" and self.buckets is not None:
            await self.client.destroy_weights_update_group()
