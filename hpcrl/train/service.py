"""What a trainer rank does for each RPC method: the engine's collectives, called in lockstep.

The controller sends every method to every rank at once (each with its own shard of a batch), and the
RPC server runs the handlers one at a time, in arrival order, so the ranks' collectives line up.
"""

from __future__ import annotations

import json
import os
import time

from hpcrl.config.schema import Config
from hpcrl.net import PortAllocator
from hpcrl.rpc.messages import (
    Ack,
    ComputeLogprobs,
    ExportWeights,
    HostWeightGroup,
    JoinWeightGroup,
    LoadCheckpoint,
    LogprobsResult,
    Ping,
    Pong,
    PushWeights,
    SaveCheckpoint,
    SequenceBatch,
    TrainerInfo,
    TrainerState,
    TrainStep,
    TrainStepResult,
    WeightGroupAddress,
    WeightSpecs,
    WeightSpecsRequest,
)
from hpcrl.seeds import derive_seed
from hpcrl.train.algorithms import needs_proximal
from hpcrl.train.batch import Sequence
from hpcrl.train.checkpoint import load_checkpoint, save_checkpoint
from hpcrl.train.engine import Engine
from hpcrl.train.lora import LoraAdapter, LoraAdapterRequest
from hpcrl.train.lora_reference import BaseReference
from hpcrl.train.loss import make_loss_fn
from hpcrl.train.weight_push import (
    host_weight_group,
    join_weight_group,
    leave_weight_group,
    push_over_group,
    push_to_disk,
    weight_specs,
)


class EngineService:
    """What every FSDP rank answers, the trainer's and the critic's: liveness, its step, exports, checkpoints."""

    def __init__(self, engine: Engine, rank: int):
        self.engine, self.rank = engine, rank

    def handlers(self) -> dict:
        return {
            "ping": self.ping,
            "info": self.info,
            "export_weights": self.export_weights,
            "save_checkpoint": self.save_checkpoint,
            "load_checkpoint": self.load_checkpoint,
        }

    def ping(self, _: Ping) -> Pong:
        return Pong(self.rank, os.getpid())

    def info(self, _: TrainerInfo) -> TrainerState:
        return TrainerState(self.rank, self.engine.step)

    def export_weights(self, msg: ExportWeights) -> Ack:
        self.engine.export_hf(msg.path)
        return Ack()

    def save_checkpoint(self, msg: SaveCheckpoint) -> Ack:
        save_checkpoint(self.engine, msg.path)
        return Ack()

    def load_checkpoint(self, msg: LoadCheckpoint) -> Ack:
        load_checkpoint(self.engine, msg.path)
        return Ack()


class TrainerService(EngineService):
    """The handlers of one rank. ``reference`` is the frozen initial policy, kept when ``algorithm.kl.coef > 0``: a
    second engine, or with LoRA the engine's own base (its adapters switched off)."""

    def __init__(
        self,
        engine: Engine,
        cfg: Config,
        rank: int,
        reference: Engine | BaseReference | None = None,
        *,
        weight_host: str = "",  # this node's advertised address: rank 0 hosts the weight group's rendezvous there
        ports: PortAllocator | None = None,  # this worker's own port slice, for that rendezvous
    ):
        super().__init__(engine, rank)
        self.reference = reference
        self.weight_host, self.ports = weight_host, ports
        self.host = None  # rank 0's rendezvous of the weight-update group, once started
        self.loss_fn = make_loss_fn(cfg.algorithm, cfg.rollout.max_new_tokens)
        self.needs_proximal = needs_proximal(cfg.algorithm)
        self.merged = cfg.export.merged  # with LoRA: exports also hold the merged model (export.merged)
        self.seed = cfg.run.seed  # the random draws of each update (LoRA dropout) derive from it
        self.group = None  # rank 0's membership of the weight-update group, once joined

    def handlers(self) -> dict:
        return {
            **super().handlers(),
            "train_step": self.train_step,
            "compute_logprobs": self.compute_logprobs,
            "host_weight_group": self.host_weight_group,
            "join_weight_group": self.join_weight_group,
            "weight_specs": self.weight_specs,
            "push_weights": self.push_weights,
            "export_for_servers": self.export_for_servers,
            "lora_adapter": self.lora_adapter,
            "shutdown": self.shutdown,
        }

    def train_step(self, msg: TrainStep) -> TrainStepResult:
        """One optimizer step; first the reference policy's logprobs (KL term), which the controller does not have.

        Collective, like the step. Decoupled PPO's proximal logprobs come with the sequences: the controller
        takes them once per step, for the whole batch, before its first update (``compute_logprobs``), since
        with ``algorithm.updates_per_batch > 1`` this policy has changed by the second call. With ``export_to``
        the updated weights are then written there for the servers, as ``export_for_servers`` writes them (the
        disk weight sync's export without a call of its own); its time is the metric ``time_weights_export_s``.
        """
        sequences = _sequences(msg.batch)
        if missing := [i for i, s in enumerate(sequences) if s.old_logprobs is None]:
            raise ValueError(
                f"sequence(s) {_first(missing)} of this rank's {len(sequences)} have no old_logprobs: the policy loss "
                "needs the behaviour policy's logprobs of the sampled tokens, as the servers reported them"
            )
        if self.needs_proximal and any(s.prox_logprobs is None for s in sequences):
            raise ValueError(
                "algorithm.behavior_weight_cap > 0 (decoupled PPO) and algorithm.off_policy.kind need prox_logprobs on "
                "every sequence: the "
                "policy's logprobs before the step's first update, from compute_logprobs over the whole batch"
            )
        if self.reference is not None:
            for seq, lp in zip(sequences, self.reference.sequence_logprobs(sequences, msg.temperature), strict=True):
                seq.ref_logprobs = lp
        _seed_update(self.seed, self.engine.step, self.rank)
        metrics = self.engine.train_step(sequences, self.loss_fn, msg.temperature)
        if msg.export_to:
            start = time.monotonic()
            push_to_disk(self.engine, msg.export_to)
            metrics["time_weights_export_s"] = round(time.monotonic() - start, 4)
        return TrainStepResult(metrics)

    def export_weights(self, msg: ExportWeights) -> Ack:
        """final/ and exports/step_N: the model (with LoRA the adapter in PEFT's layout, and with
        ``export.merged`` the merged model in ``merged/`` beside it)."""
        self.engine.export_hf(msg.path, merged=self.merged and self.engine.lora)
        return Ack()

    def compute_logprobs(self, msg: ComputeLogprobs) -> LogprobsResult:
        sequences = _sequences(msg.batch)
        return LogprobsResult.of(self.engine.sequence_logprobs(sequences, msg.temperature))

    def host_weight_group(self, msg: HostWeightGroup) -> WeightGroupAddress:
        """Rank 0: listen for the weight-update group on this node, on a port of this worker's own slice."""
        if self.rank != 0:
            return WeightGroupAddress("", 0, "")
        if self.ports is None or not self.weight_host:
            raise RuntimeError("this trainer was started without its host and port slice, so it cannot host the group")
        port = self.ports.allocate(1)[0]
        self.host = host_weight_group(self.engine, self.weight_host, port, timeout_s=msg.timeout_s)
        assert self.host is not None
        return WeightGroupAddress(self.host.host, self.host.port, self.host.backend)

    def join_weight_group(self, msg: JoinWeightGroup) -> Ack:
        self.group = join_weight_group(self.engine, self.host, msg.world_size, msg.group_name, msg.timeout_s)
        return Ack()

    def weight_specs(self, msg: WeightSpecsRequest) -> WeightSpecs:
        specs = weight_specs(self.engine, msg.dtype)
        return WeightSpecs([n for n, _, _ in specs], [d for _, d, _ in specs], [s for _, _, s in specs])

    def push_weights(self, msg: PushWeights) -> Ack:
        push_over_group(self.engine, self.group, msg.dtype)
        return Ack()

    def export_for_servers(self, msg: ExportWeights) -> Ack:
        """The disk weight sync's export (``push_to_disk``): the weights alone, for ``/update_weights_from_disk``; with
        LoRA the adapter in PEFT's layout, for ``/load_lora_adapter``."""
        push_to_disk(self.engine, msg.path)
        return Ack()

    def lora_adapter(self, _: LoraAdapterRequest) -> LoraAdapter:
        """With LoRA: the adapter for ``/load_lora_adapter_from_tensors``: its config and, on rank 0, its tensors by
        PEFT name ({} on the other ranks). Collective (the adapters are gathered); refused without LoRA."""
        return LoraAdapter(json.dumps(self.engine.adapter_config()), self.engine.adapter_tensors())

    def shutdown(self, _: object = None) -> Ack:
        if self.group is not None:
            leave_weight_group(self.group)
            self.group = None
        return Ack()


def _seed_update(seed: int, update: int, rank: int) -> None:
    """Seed the global generators, which LoRA dropout draws from, for optimizer update ``update`` on ``rank``.

    Their state is in no checkpoint: seeded per update from ``run.seed``, a run resumed from its checkpoint (which
    restores the update count) draws what the uninterrupted run drew, where a new process would start over."""
    import torch

    torch.manual_seed(derive_seed(seed, "train", update, rank))


def _first(indices: list[int], shown: int = 8) -> str:
    """``indices`` as a short list: the first ``shown`` of them, and how many more."""
    more = f" and {len(indices) - shown} more" if len(indices) > shown else ""
    return ", ".join(map(str, indices[:shown])) + more


def _sequences(batch: SequenceBatch) -> list[Sequence]:
    """The engine's rows of a packed batch (the wire's SequenceData fields are Sequence's, in the same order)."""
    return [Sequence(**vars(s)) for s in batch.unpack()]
