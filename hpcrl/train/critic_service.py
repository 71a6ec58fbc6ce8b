"""What a critic rank does for each RPC method: the value engine's collectives, called in lockstep.

The critic is a role of its own (``allocation.critic``): torchrun ranks like the trainer's, another process
group, another model (``ValueEngine``). The controller asks it for the values of a step's batch before the
actor's update (``compute_values``), computes GAE from them, and then trains it on the same batch
(``train_step``, the clipped value loss against the returns) beside the actor's update. Liveness, exports and
checkpoints are every FSDP rank's (``EngineService``).
"""

from __future__ import annotations

from hpcrl.config.schema import Config
from hpcrl.rpc.messages import ComputeValues, TrainStep, TrainStepResult, ValuesResult
from hpcrl.train.loss import make_value_loss_fn
from hpcrl.train.service import EngineService, _sequences
from hpcrl.train.value_engine import ValueEngine


class CriticService(EngineService):
    """The handlers of one critic rank."""

    def __init__(self, engine: ValueEngine, cfg: Config, rank: int):
        super().__init__(engine, rank)
        self.loss_fn = make_value_loss_fn(cfg.algorithm, cfg.rollout.max_new_tokens)

    def handlers(self) -> dict:
        return {**super().handlers(), "compute_values": self.compute_values, "train_step": self.train_step}

    def compute_values(self, msg: ComputeValues) -> ValuesResult:
        return ValuesResult.of(self.engine.sequence_values(_sequences(msg.batch)))

    def train_step(self, msg: TrainStep) -> TrainStepResult:
        """One optimizer step of the value loss on this rank's shard (every sequence with returns and old values)."""
        if msg.export_to:
            raise ValueError(
                f"a critic writes no weights for the servers; its train step got export_to={msg.export_to!r}"
            )
        sequences = _sequences(msg.batch)
        missing = next((i for i, s in enumerate(sequences) if s.returns is None or s.old_values is None), None)
        if missing is not None:
            raise ValueError(f"sequence {missing}: a critic's train step needs returns and old_values (from GAE)")
        return TrainStepResult(self.engine.train_step(sequences, self.loss_fn))
