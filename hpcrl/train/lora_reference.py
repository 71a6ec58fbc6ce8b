"""The KL penalty's reference policy with LoRA (``hpcrl.train.lora``): the policy's own model with its adapters off.

A module of its own: it wraps an ``Engine``, whose module imports ``lora`` to wrap the model.
"""

from __future__ import annotations

from typing import Any

from hpcrl.train.batch import Sequence
from hpcrl.train.engine import Engine


class BaseReference:
    """The KL penalty's reference policy with LoRA: the engine's own model with its adapters switched off, which
    is the initial policy (peft starts ``lora_B`` at zero). Answers ``sequence_logprobs`` as a reference
    ``Engine`` does, with no second copy of the model. Collective, as the engine's."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def sequence_logprobs(self, sequences: list[Sequence], temperature: float = 1.0) -> list[list[float]]:
        model: Any = self.engine.require_setup()[0]  # a peft model: the engine wraps it with LoRA on
        with model.disable_adapter():
            return self.engine.sequence_logprobs(sequences, temperature)
