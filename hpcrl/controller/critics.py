"""The critic's ranks as the controller sees them: one RPC endpoint per rank, called in lockstep, like the
trainers (``trainers.py``): every method is collective on the critic's side, each rank gets its own shard."""

from __future__ import annotations

from typing import Any

from hpcrl.rpc.client import RpcClient
from hpcrl.rpc.messages import (
    ComputeValues,
    ExportWeights,
    LoadCheckpoint,
    SaveCheckpoint,
    SequenceBatch,
    SequenceData,
    TrainStep,
)


class Critics:
    def __init__(self, addresses: list[str], token: str, timeout_s: float = 1800.0):
        self.addresses = addresses
        self.world_size = len(addresses)
        self.rpc = RpcClient(addresses, token, timeout_s=timeout_s)

    async def __aenter__(self) -> Critics:
        await self.rpc.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.rpc.__aexit__(*exc)

    async def values(self, shards: list[list[SequenceData]]) -> list[list[list[float]]]:
        """Per-token values of each shard's sequences, aligned with their input_ids (one forward, no update)."""
        replies = await self.rpc.call("compute_values", [ComputeValues(SequenceBatch.pack(s)) for s in shards])
        return [reply.per_sequence() for reply in replies]

    async def train_step(self, shards: list[list[SequenceData]]) -> dict[str, float]:
        """One optimizer step of the value loss on the batch split in ``shards``; global metrics."""
        replies = await self.rpc.call("train_step", [TrainStep(SequenceBatch.pack(s), 1.0) for s in shards])
        return replies[0].metrics

    async def export(self, path) -> None:
        await self.rpc.broadcast("export_weights", ExportWeights(str(path)))

    async def save_checkpoint(self, path) -> None:
        await self.rpc.broadcast("save_checkpoint", SaveCheckpoint(str(path)))

    async def load_checkpoint(self, path) -> None:
        await self.rpc.broadcast("load_checkpoint", LoadCheckpoint(str(path)))

    async def shutdown(self) -> None:
        await self.rpc.shutdown()
