"""The critic's network: the policy's transformer backbone with a scalar value head, one value per token.

The critic's ranks shard it in ``value_engine.py``; this module is the model alone.

A value model directory is the backbone in the Hugging Face layout (``config.json``, ``model.safetensors``,
as ``AutoModel`` saves a bare decoder) plus ``value_head.safetensors`` (the head's ``weight`` and ``bias``).
``ValueModel.from_pretrained`` reads either that or a policy's causal-LM directory, whose backbone it takes
without the LM head and gives a fresh head.

Alignment: ``values[:, t]`` is the value of the prefix ``input_ids[:, :t+1]``, the state in which token
``t + 1`` is chosen, so ``values[:, :-1]`` lines up with a ``MicroBatch``'s ``[B, T-1]`` per-token tensors
(column ``t`` is about token ``t + 1``) exactly as ``Engine.token_logprobs`` does.

FSDP2: a plain ``nn.Module``; shard each of ``backbone.layers``, then the root, as the engine does a policy.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from hpcrl.rundir import write_dir_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """``backbone`` (a decoder without its LM head, e.g. ``Qwen2Model``) and ``head = nn.Linear(hidden, 1)``.

    The head starts at zero, weight and bias: every value is then exactly 0 before the first update, so
    the first advantages are the plain discounted returns rather than noise of the size of the backbone's
    hidden states (whose norms run to the hundreds in real models), and the first value-loss gradients do
    not carry that noise into the backbone. The head's own gradient, ``dL/dv * hidden``, is not zero, so
    it learns from the first step; the backbone follows once the head is non-zero.
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        hidden = getattr(getattr(backbone, "config", None), "hidden_size", None)
        if not isinstance(hidden, int) or getattr(backbone, "layers", None) is None:
            raise ValueError(
                f"a value model's backbone must be a decoder with config.hidden_size and .layers "
                f"(Llama/Qwen layout, as AutoModel loads it), got {type(backbone).__name__}"
            )
        self.backbone: PreTrainedModel = backbone
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``[B, T]`` float32 values of right-padded rows; exactly 0 at padded positions."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        values = self.head(hidden).squeeze(-1).float()
        return values.masked_fill(attention_mask == 0, 0.0)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
        """The backbone of the model at ``path`` with its saved head, or a fresh zero head if it has none."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        path = Path(path)
        backbone, info = AutoModel.from_pretrained(path, dtype=dtype, output_loading_info=True)
        if info["missing_keys"]:
            raise ValueError(
                f"{path}: the backbone's weights {sorted(info['missing_keys'])[:5]} are missing from the directory; "
                "pass the policy's model directory or a value model saved by ValueModel.save_pretrained"
            )
        model = cls(backbone)
        head_file = path / HEAD_FILE
        if head_file.exists():
            try:
                model.head.load_state_dict(load_file(head_file), strict=True)
            except RuntimeError as exc:
                raise ValueError(
                    f"{head_file} does not fit a backbone of hidden size {model.head.in_features}: {exc}"
                ) from exc
            logger.info("value model from %s with its saved head", path)
        else:
            logger.info("value model from %s: the backbone's weights, a fresh zero head (no %s)", path, HEAD_FILE)
        return model.to(dtype)

    def save_pretrained(self, out_dir: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Write the backbone (Hugging Face layout, safetensors) and ``value_head.safetensors`` to ``out_dir``.

        ``state_dict`` is this module's full state dict when the parameters themselves are sharded (gather
        it first, e.g. with ``get_model_state_dict(..., full_state_dict=True)``); default: ``self.state_dict()``.
        Written into a sibling temporary directory and renamed, so a reader never sees half a model; an
        existing ``out_dir`` is replaced.
        """
        from safetensors.torch import save_file

        out = Path(out_dir)
        state = self.state_dict() if state_dict is None else state_dict
        backbone_state = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        head_state = {k.removeprefix("head."): v.contiguous() for k, v in state.items() if k.startswith("head.")}

        def fill(tmp: Path) -> None:
            # save_pretrained empties the dict it is given (transformers 5.x): hand it one of its own
            self.backbone.save_pretrained(tmp, state_dict=backbone_state, safe_serialization=True)
            save_file(head_state, tmp / HEAD_FILE, metadata={"format": "pt"})

        write_dir_atomic(out, fill)
        return out
