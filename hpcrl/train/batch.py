"""What one train step consumes: ``Sequence`` rows in, ``MicroBatch`` tensors and a ``Normalizer`` out.

Alignment, the one convention to remember:

- A ``Sequence``'s per-token lists (``loss_mask``, ``*_logprobs``, ``versions``) are aligned with its
  ``input_ids``: entry ``t`` describes token ``t`` (prompt tokens carry ``loss_mask`` 0). Token 0 has no
  prediction, so its ``loss_mask`` must be 0 and its logprob entries are ignored. This is how a rollout
  records a sample: prompt + completion ids, the server's logprob of each completion token at its place.
- A ``MicroBatch``'s per-token tensors are aligned with the model's predictions, ``[B, T-1]``: column
  ``t`` holds what the sequence said about token ``t + 1``, the same layout ``Engine.token_logprobs``
  returns, so a loss function multiplies them elementwise without shifting anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Per-token float fields of a Sequence that become [B, T-1] tensors of a MicroBatch.
LOGPROB_FIELDS = ("old_logprobs", "prox_logprobs", "ref_logprobs")
# ... and those of PPO with a critic (advantage=gae): per-token advantages, the critic's targets and its old values
CRITIC_FIELDS = ("token_advantages", "returns", "old_values")
FLOAT_FIELDS = (*LOGPROB_FIELDS, *CRITIC_FIELDS)


@dataclass
class Sequence:
    """One sample: prompt and completion token ids, which tokens carry loss, and what the rollout recorded."""

    input_ids: list[int]  # prompt + completion token ids, length T >= 2
    loss_mask: list[int]  # length T, aligned with input_ids: 1 where token t carries loss; entry 0 must be 0
    advantage: float = 0.0  # one advantage for the whole sequence
    old_logprobs: list[float] | None = None  # length T: behaviour policy's logprob of token t (server or recompute)
    prox_logprobs: list[float] | None = None  # length T: the trainer's policy before this update (decoupled PPO)
    ref_logprobs: list[float] | None = None  # length T: the frozen reference policy (KL penalty)
    versions: list[int] | None = None  # length T: policy version that sampled token t; -1 for prompt tokens
    token_advantages: list[float] | None = None  # length T: token t's advantage (GAE); replaces ``advantage``
    returns: list[float] | None = None  # length T: token t's GAE return, the critic's target
    old_values: list[float] | None = None  # length T: the critic's value of the state before token t, pre-update

    def validate(self, index: int) -> None:
        """Raise ValueError naming row ``index`` and the field when the lengths or the mask are wrong."""
        length = len(self.input_ids)
        if length < 2:
            raise ValueError(f"sequence {index}: input_ids needs at least 2 tokens (one to predict), got {length}")
        for name in ("loss_mask", *FLOAT_FIELDS, "versions"):
            values = getattr(self, name)
            if values is not None and len(values) != length:
                raise ValueError(
                    f"sequence {index}: {name} has {len(values)} entries but input_ids has {length}; "
                    "per-token fields are aligned with input_ids (entry t describes token t)"
                )
        if self.loss_mask[0] != 0:
            raise ValueError(
                f"sequence {index}: loss_mask[0] must be 0 (token 0 has no prediction); the mask is aligned "
                "with input_ids, so mark completion tokens at their own positions"
            )

    @property
    def loss_tokens(self) -> int:
        return sum(1 for m in self.loss_mask if m)


@dataclass(frozen=True)
class Normalizer:
    """Counts over the GLOBAL batch of one train step (every rank, every micro-batch).

    A loss function divides its micro-batch's partial sum by one of these, so the partial losses of all
    micro-batches on all ranks add up to the loss of the whole batch computed at once.
    """

    tokens: int  # tokens with loss_mask != 0
    sequences: int  # sequences with at least one such token (the unit of per-sequence means)


@dataclass
class MicroBatch:
    """Right-padded tensors of the sequences in one micro-batch, on the engine's device.

    Per-token tensors are ``[B, T-1]`` (column t is about token t+1; see the module docstring); padding
    positions have ``loss_mask`` 0, logprobs 0 and versions -1. Optional tensors are None when the
    sequences did not carry that field.
    """

    input_ids: Tensor  # [B, T] long, padded with the pad id
    attention_mask: Tensor  # [B, T] long, 1 on real tokens
    loss_mask: Tensor  # [B, T-1] float32, 1.0 where the predicted token carries loss
    advantages: Tensor  # [B] float32, one per sequence
    old_logprobs: Tensor | None = None  # [B, T-1] float32
    prox_logprobs: Tensor | None = None  # [B, T-1] float32
    ref_logprobs: Tensor | None = None  # [B, T-1] float32
    versions: Tensor | None = None  # [B, T-1] long
    token_advantages: Tensor | None = None  # [B, T-1] float32: per-token advantages, used instead of ``advantages``
    returns: Tensor | None = None  # [B, T-1] float32: the critic's targets
    old_values: Tensor | None = None  # [B, T-1] float32: the critic's values when the advantages were computed

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


def check_optional_fields(sequences: list[Sequence]) -> None:
    """Each optional per-token field must be set on every sequence or on none (a batch is one tensor)."""
    for name in (*FLOAT_FIELDS, "versions"):
        present = [getattr(s, name) is not None for s in sequences]
        if any(present) and not all(present):
            missing = present.index(False)
            raise ValueError(
                f"sequence {missing} has no {name} while others have it; set {name} on every sequence or on none"
            )


def _padded(rows: list[list], width: int, fill: float) -> list[list]:
    return [[*row, *([fill] * (width - len(row)))] for row in rows]


def collate(sequences: list[Sequence], pad_id: int, device: torch.device) -> MicroBatch:
    """Right-pad ``sequences`` into a ``MicroBatch`` (per-token fields shifted to ``[B, T-1]``).

    Each field is padded as Python lists and becomes one tensor in one call: a ``torch.tensor`` per row and
    field cost about 0.1 ms each, most of a small micro-batch's collation."""
    width = max(len(s.input_ids) for s in sequences)
    lengths = torch.tensor([len(s.input_ids) for s in sequences])
    input_ids = torch.tensor(_padded([s.input_ids for s in sequences], width, pad_id), dtype=torch.long)
    attention_mask = (torch.arange(width) < lengths[:, None]).long()
    shifted = _padded([s.loss_mask[1:] for s in sequences], width - 1, 0)
    loss_mask = torch.tensor(shifted, dtype=torch.float32).ne(0).float()
    optional = {
        name: torch.tensor(_padded([getattr(s, name)[1:] for s in sequences], width - 1, 0.0), dtype=torch.float32)
        for name in FLOAT_FIELDS
        if getattr(sequences[0], name) is not None
    }
    versions = None
    if sequences[0].versions is not None:
        rows = [s.versions[1:] if s.versions is not None else [] for s in sequences]
        versions = torch.tensor(_padded(rows, width - 1, -1), dtype=torch.long)
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32)
    moved = {name: t.to(device) for name, t in optional.items()}
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        loss_mask=loss_mask.to(device),
        advantages=advantages.to(device),
        versions=None if versions is None else versions.to(device),
        **moved,
    )
