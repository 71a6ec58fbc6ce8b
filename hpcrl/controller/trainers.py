"""The trainer ranks as the controller sees them: one RPC endpoint per rank, called in lockstep.

Every method is collective on the trainers' side (FSDP gathers, the optimizer step), so each call goes
to every rank at once; rank r gets its own shard where there is one. Replies are gathered in rank order.
"""

from __future__ import annotations

from typing import Any

from hpcrl.rpc.client import RpcClient
from hpcrl.rpc.messages import (
    ComputeLogprobs,
    ExportWeights,
    JoinWeightGroup,
    LoadCheckpoint,
    PushWeights,
    SaveCheckpoint,
    SequenceData,
    TrainStep,
    WeightSpecsRequest,
)


class Trainers:
    def __init__(self, addresses: list[str], token: str, temperature: float, timeout_s: float = 1800.0):
        self.addresses = addresses
        self.world_size = len(addresses)
        self.temperature = temperature
        self.weights_backend = "gloo"  # the trainers report nccl when they run on GPUs (join_weight_group)
        self.rpc = RpcClient(addresses, token, timeout_s=timeout_s)

    async def __aenter__(self) -> Trainers:
        await self.rpc.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.rpc.__aexit__(*exc)

    async def train_step(self, shards: list[list[SequenceData]]) -> dict[str, float]:
        """One optimizer step on the global batch split in ``shards`` (one per rank); global metrics."""
        replies = await self.rpc.call("train_step", [TrainStep(s, self.temperature) for s in shards])
        return replies[0].metrics

    async def compute_logprobs(self, shards: list[list[SequenceData]]) -> list[list[list[float]]]:
        """Per-token logprobs of the current policy for each shard's sequences (one forward, no update)."""
        replies = await self.rpc.call("compute_logprobs", [ComputeLogprobs(s, self.temperature) for s in shards])
        return [reply.logprobs for reply in replies]

    async def export(self, path) -> None:
        await self.rpc.broadcast("export_weights", ExportWeights(str(path)))

    async def save_checkpoint(self, path) -> None:
        await self.rpc.broadcast("save_checkpoint", SaveCheckpoint(str(path)))

    async def load_checkpoint(self, path) -> None:
        """Every rank restores model, optimizer, LR schedule and step from a ``save_checkpoint`` directory."""
        await self.rpc.broadcast("load_checkpoint", LoadCheckpoint(str(path)))

    async def join_weight_group(self, master_address: str, master_port: int, world_size: int) -> None:
        request = JoinWeightGroup(master_address, master_port, world_size, "weight_update_group", self.weights_backend)
        await self.rpc.broadcast("join_weight_group", request)

    async def weight_specs(self) -> tuple[list[str], list[str], list[list[int]]]:
        spec = (await self.rpc.broadcast("weight_specs", WeightSpecsRequest()))[0]
        return spec.names, spec.dtypes, spec.shapes

    async def push_weights(self, version: int) -> None:
        await self.rpc.broadcast("push_weights", PushWeights(version))

    async def shutdown(self) -> None:
        await self.rpc.shutdown()
