"""The critic's ranks as the controller sees them: one RPC endpoint per rank, called in lockstep, like the
trainers (``trainers.py``): every method is collective on the critic's side, each rank gets its own shard."""

from __future__ import annotations

from hpcrl.controller.trainers import Ranks
from hpcrl.rpc.messages import ComputeValues, SequenceBatch, SequenceData, TrainStep


class Critics(Ranks):
    async def values(self, shards: list[list[SequenceData]]) -> list[list[list[float]]]:
        """Per-token values of each shard's sequences, aligned with their input_ids (one forward, no update)."""
        replies = await self.rpc.call("compute_values", [ComputeValues(SequenceBatch.pack(s)) for s in shards])
        return [reply.per_sequence() for reply in replies]

    async def train_step(self, shards: list[list[SequenceData]]) -> dict[str, float]:
        """One optimizer step of the value loss on the batch split in ``shards``; global metrics."""
        replies = await self.rpc.call("train_step", [TrainStep(SequenceBatch.pack(s), 1.0) for s in shards])
        return replies[0].metrics
