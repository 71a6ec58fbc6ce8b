"""The trainer ranks as the controller sees them: one RPC endpoint per rank, called in lockstep.

Every method is collective on the trainers' side (FSDP gathers, the optimizer step), so each call goes
to every rank at once; rank r gets its own shard where there is one, packed into a SequenceBatch (flat
tensors, which travel as raw bytes). Replies are gathered in rank order.
"""

from __future__ import annotations

import json
from typing import Any, Self

from hpcrl.inference.weight_layout import DEFAULT_GROUP
from hpcrl.rpc.client import RpcClient
from hpcrl.rpc.messages import (
    ComputeLogprobs,
    ExportWeights,
    HostWeightGroup,
    JoinWeightGroup,
    LoadCheckpoint,
    PushWeights,
    SaveCheckpoint,
    SequenceBatch,
    SequenceData,
    TrainStep,
    WeightSpecsRequest,
)
from hpcrl.train.lora import LoraAdapterRequest  # and its reply, LoraAdapter: registered for RPC by the import


class Ranks:
    """What the controller asks every FSDP rank, the trainer's and the critic's: exports, checkpoints, shutdown."""

    def __init__(self, addresses: list[str], token: str, timeout_s: float = 1800.0):
        self.addresses = addresses
        self.world_size = len(addresses)
        self.rpc = RpcClient(addresses, token, timeout_s=timeout_s)

    async def __aenter__(self) -> Self:
        await self.rpc.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.rpc.__aexit__(*exc)

    async def export(self, path) -> None:
        await self.rpc.broadcast("export_weights", ExportWeights(str(path)))

    async def save_checkpoint(self, path) -> None:
        await self.rpc.broadcast("save_checkpoint", SaveCheckpoint(str(path)))

    async def load_checkpoint(self, path) -> None:
        """Every rank restores model, optimizer, LR schedule and step from a ``save_checkpoint`` directory."""
        await self.rpc.broadcast("load_checkpoint", LoadCheckpoint(str(path)))

    async def shutdown(self) -> None:
        await self.rpc.shutdown()


class Trainers(Ranks):
    def __init__(self, addresses: list[str], token: str, temperature: float, timeout_s: float = 1800.0):
        super().__init__(addresses, token, timeout_s)
        self.temperature = temperature

    async def train_step(self, shards: list[list[SequenceData]], export_to: str = "") -> dict[str, float]:
        """One optimizer step on the global batch split in ``shards`` (one per rank); global metrics. With
        ``export_to``, rank 0 then writes the new weights there, as ``export_for_servers`` does, before replying."""
        requests = [TrainStep(SequenceBatch.pack(s), self.temperature, export_to) for s in shards]
        replies = await self.rpc.call("train_step", requests)
        return replies[0].metrics

    async def compute_logprobs(self, shards: list[list[SequenceData]]) -> list[list[list[float]]]:
        """Per-token logprobs of the current policy for each shard's sequences (one forward, no update)."""
        requests = [ComputeLogprobs(SequenceBatch.pack(s), self.temperature) for s in shards]
        replies = await self.rpc.call("compute_logprobs", requests)
        return [reply.per_sequence() for reply in replies]

    async def host_weight_group(self, timeout_s: float) -> tuple[str, int, str]:
        """Rank 0 starts the weight-update group's rendezvous on its own node, on a port of its own slice;
        (its host, that port, the backend it sends over: nccl on CUDA, else gloo)."""
        address = (await self.rpc.broadcast("host_weight_group", HostWeightGroup(timeout_s)))[0]
        return address.master_address, address.master_port, address.backend

    async def join_weight_group(self, world_size: int, timeout_s: float, group_name: str = DEFAULT_GROUP) -> None:
        """Rank 0 joins (blocking until every server rank has); the others answer at once."""
        await self.rpc.broadcast("join_weight_group", JoinWeightGroup(world_size, group_name, timeout_s))

    async def weight_specs(self, dtype: str) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, shape) of every tensor a push sends, in its order, floating-point ones as ``dtype``."""
        spec = (await self.rpc.broadcast("weight_specs", WeightSpecsRequest(dtype)))[0]
        return list(zip(spec.names, spec.dtypes, spec.shapes, strict=True))

    async def export_for_servers(self, path) -> None:
        """Rank 0 writes the weights alone (one safetensors file) to ``path`` for ``/update_weights_from_disk``."""
        await self.rpc.broadcast("export_for_servers", ExportWeights(str(path)))

    async def lora_adapter(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """With LoRA: the adapter's ``adapter_config.json`` as a dict and its full tensors by PEFT name (every rank
        gathers them; rank 0 answers with them)."""
        adapter = (await self.rpc.broadcast("lora_adapter", LoraAdapterRequest()))[0]
        return json.loads(adapter.config), adapter.tensors

    async def push_weights(self, version: int, dtype: str) -> None:
        """Every rank gathers each tensor; rank 0 broadcasts it as ``dtype`` to the weight-update group."""
        await self.rpc.broadcast("push_weights", PushWeights(version, dtype))
