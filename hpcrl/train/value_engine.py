"""The critic's engine: a ``ValueModel`` sharded with FSDP2 over the critic's ranks, trained like the policy.

Everything collective about ``Engine`` holds here too (setup, the micro-batch plan, the summed gradients,
the optimizer step, checkpoints through ``checkpoint.py``); only the model and what its forward hands the
loss differ: values ``[B, T-1]`` where column ``t`` is the value of the prefix up to token ``t``, the state
in which token ``t + 1`` is chosen (``ValueModel``'s alignment), so a MicroBatch's per-token tensors line up
with them as they do with the policy's logprobs. Its learning rate is ``train.critic_lr``; the other
optimizer settings are ``train``'s.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from torch import Tensor, nn

from hpcrl.config.schema import LoRAConfig, TrainConfig
from hpcrl.train.batch import Sequence
from hpcrl.train.engine import Engine, run_on_main
from hpcrl.train.value_model import ValueModel

logger = logging.getLogger(__name__)


class ValueEngine(Engine):
    """``model_path``: a value model directory (``ValueModel.save_pretrained``) or a causal LM's, whose backbone
    it takes with a fresh zero head."""

    def __init__(self, model_path: str | Path, train: TrainConfig, *args, **kwargs) -> None:
        """``Engine``'s arguments; the optimizer's learning rate is ``train.critic_lr``. The critic trains its full
        weights: ``train.lora`` is the policy's (and refused with a critic before launch, ``check_lora_critic``)."""
        own = replace(train, lr=train.critic_lr, lora=LoRAConfig())
        super().__init__(model_path, own, *args, **kwargs)

    def _load_model(self) -> tuple[nn.Module, nn.ModuleList, object]:
        model = ValueModel.from_pretrained(self.model_path)  # float32 master weights, as the policy's
        return model, model.backbone.layers, model.backbone.config

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, temperature: float) -> Tensor:
        model, _ = self.require_setup()
        return model(input_ids=input_ids, attention_mask=attention_mask)[:, :-1]

    def token_logprobs(self, *args, **kwargs) -> Tensor:
        raise TypeError("a value model has no token logprobs; ValueEngine.sequence_values gives its values")

    def sequence_logprobs(self, *args, **kwargs) -> list[list[float]]:
        raise TypeError("a value model has no token logprobs; ValueEngine.sequence_values gives its values")

    def sequence_values(self, sequences: list[Sequence]) -> list[list[float]]:
        """Per-token values aligned with each sequence's ``input_ids``: entry ``t`` is the value of the state in
        which token ``t`` was chosen (entry 0 is 0.0). Micro-batched, no update. Collective."""
        return self._per_sequence(sequences, temperature=1.0)

    def export_hf(self, out_dir: str | Path, merged: bool = False) -> Path:
        """The value model as ``ValueModel.save_pretrained`` writes it (backbone + ``value_head.safetensors``),
        which ``model.critic_path`` reads back. Collective; rank 0 writes. ``merged`` is refused: no adapter here."""
        if merged:
            raise ValueError("export.merged applies to the policy's LoRA adapter; the critic trains full weights")
        model, info = self.require_setup()
        out, state = Path(out_dir), self.full_state_dict()

        def write() -> None:
            model.save_pretrained(out, state_dict=state)
            logger.info("exported the critic of step %d to %s", self.step, out)

        run_on_main(info, write, what=f"critic export to {out}")
        return out
