"""What a critic rank does for each RPC method: the value engine's collectives, called in lockstep.

The critic is a role of its own (``allocation.critic``): torchrun ranks like the trainer's, another process
group, another model (``ValueEngine``). The controller asks it for the values of a step's batch before the
actor's update (``compute_values``), computes GAE from them, and then trains it on the same batch
(``train_step``, the clipped value loss against the returns) beside the actor's update.
"""

from __future__ import annotations

import os

from hpcrl.config.schema import Config
from hpcrl.rpc.messages import (
    Ack,
    ComputeValues,
    ExportWeights,
    LoadCheckpoint,
    Ping,
    Pong,
    SaveCheckpoint,
    TrainerInfo,
    TrainerState,
    TrainStep,
    TrainStepResult,
    ValuesResult,
)
from hpcrl.train.checkpoint import load_checkpoint, save_checkpoint
from hpcrl.train.loss import make_value_loss_fn
from hpcrl.train.service import _sequences
from hpcrl.train.value_engine import ValueEngine


class CriticService:
    """The handlers of one critic rank."""

    def __init__(self, engine: ValueEngine, cfg: Config, rank: int):
        self.engine, self.rank = engine, rank
        self.loss_fn = make_value_loss_fn(cfg.algorithm, cfg.rollout.max_new_tokens)

    def handlers(self) -> dict:
        return {
            "ping": self.ping,
            "info": self.info,
            "compute_values": self.compute_values,
            "train_step": self.train_step,
            "export_weights": self.export_weights,
            "save_checkpoint": self.save_checkpoint,
            "load_checkpoint": self.load_checkpoint,
        }

    def ping(self, _: Ping) -> Pong:
        return Pong(self.rank, os.getpid())

    def info(self, _: TrainerInfo) -> TrainerState:
        return TrainerState(self.rank, self.engine.step)

    def compute_values(self, msg: ComputeValues) -> ValuesResult:
        return ValuesResult.of(self.engine.sequence_values(_sequences(msg.batch)))

    def train_step(self, msg: TrainStep) -> TrainStepResult:
        """One optimizer step of the value loss on this rank's shard (every sequence with returns and old values)."""
        sequences = _sequences(msg.batch)
        missing = next((i for i, s in enumerate(sequences) if s.returns is None or s.old_values is None), None)
        if missing is not None:
            raise ValueError(f"sequence {missing}: a critic's train step needs returns and old_values (from GAE)")
        return TrainStepResult(self.engine.train_step(sequences, self.loss_fn))

    def export_weights(self, msg: ExportWeights) -> Ack:
        self.engine.export_hf(msg.path)
        return Ack()

    def save_checkpoint(self, msg: SaveCheckpoint) -> Ack:
        save_checkpoint(self.engine, msg.path)
        return Ack()

    def load_checkpoint(self, msg: LoadCheckpoint) -> Ack:
        load_checkpoint(self.engine, msg.path)
        return Ack()
