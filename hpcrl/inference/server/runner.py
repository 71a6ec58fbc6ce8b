"""The torch side of the CPU server: load a Hugging Face model, prefill and decode one batch, swap weights.

Everything here is synchronous and runs on one dedicated thread, so the HTTP event loop stays free to
answer health checks, pauses and aborts while a batch decodes.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hpcrl.inference.server.sampling import BatchSampler

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BatchState:
    """The tensors of a batch between two decode steps; row i belongs to ``seq_ids[i]``."""

    seq_ids: list[int]
    attention_mask: torch.Tensor  # [B, L], left-padded prompt plus generated tokens
    positions: torch.Tensor  # [B], position of the last token of each row
    cache: object  # transformers DynamicCache
    sampler: BatchSampler
    tokens: torch.Tensor  # [B], the tokens sampled last
    logprobs: torch.Tensor  # [B], their logprobs
    adapters: list[str | None]  # each row's LoRA adapter id (``lora_model.py``); None = the base model


class ModelRunner:
    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0):
        from transformers import AutoModelForCausalLM

        from hpcrl.models.tokenizer import load_tokenizer

        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).eval()
        self.generator = torch.Generator().manual_seed(seed)
        config = self.model.config
        self.vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", 1 << 30)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        # transformers 5 renamed the forward's past_key_values to cache; 4.x (SGLang's pins) knows only the old name
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"
        # the prefill needs the logits of the last position only: not [B, L, vocab] of them
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self.adapter_layers: list[torch.nn.Module] = []  # PEFT's LoRA layers, once an adapter is loaded
        log.info("loaded %s (%s, vocab %d, eos %s)", model_path, dtype, self.vocab_size, sorted(self.eos_ids))

    @torch.inference_mode()
    def prefill(
        self,
        seq_ids: list[int],
        prompts: list[list[int]],
        sampler: BatchSampler,
        adapters: list[str | None] | None = None,
    ) -> BatchState:
        """One forward over the batch's distinct prompts (a GRPO group sends one prompt ``n`` times: it is
        computed once, as SGLang's prefix cache would), its KV cache and last logits then copied to every row
        that asked for it; each row samples its own first token. ``adapters``: each row's LoRA adapter id
        (None: the base model); a prompt is one prompt per adapter."""
        from transformers import DynamicCache

        adapters = adapters or [None] * len(prompts)
        first_row: dict[tuple[str | None, tuple[int, ...]], int] = {}
        rows = [first_row.setdefault((a, tuple(p)), len(first_row)) for a, p in zip(adapters, prompts, strict=True)]
        distinct = [list(p) for _, p in first_row]
        width = max(len(p) for p in distinct)
        ids = torch.full((len(distinct), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for row, prompt in enumerate(distinct):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        with self._adapters([a for a, _ in first_row]):
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, **{self._cache_kw: cache}, **self._last_only
            )
        logits = out.logits[:, -1]
        if len(distinct) < len(prompts):
            index = torch.tensor(rows, dtype=torch.long)
            cache.batch_select_indices(index)
            logits, mask, positions = logits[index], mask[index], positions[index]
        tokens, logprobs = sampler.sample(logits, self.generator)
        return BatchState(seq_ids, mask, positions[:, -1], cache, sampler, tokens, logprobs, list(adapters))

    @torch.inference_mode()
    def decode(self, state: BatchState) -> None:
        """Feed the last sampled tokens and sample the next ones, in place."""
        state.attention_mask = torch.cat([state.attention_mask, torch.ones_like(state.tokens)[:, None]], dim=1)
        state.positions = state.positions + 1
        with self._adapters(state.adapters):
            out = self.model(
                input_ids=state.tokens[:, None],
                attention_mask=state.attention_mask,
                position_ids=state.positions[:, None],
                **{self._cache_kw: state.cache},
            )
        state.tokens, state.logprobs = state.sampler.sample(out.logits[:, -1], self.generator)

    @staticmethod
    def keep_rows(state: BatchState, rows: list[int]) -> None:
        """Drop finished rows from the batch (and from the KV cache)."""
        keep = torch.tensor(rows, dtype=torch.long)
        state.cache.batch_select_indices(keep)
        state.seq_ids = [state.seq_ids[r] for r in rows]
        state.attention_mask = state.attention_mask[keep]
        state.positions, state.tokens, state.logprobs = state.positions[keep], state.tokens[keep], state.logprobs[keep]
        state.sampler = state.sampler.select(keep)
        state.adapters = [state.adapters[r] for r in rows]

    @staticmethod
    def merge(state: BatchState, joining: BatchState) -> None:
        """Add the rows of a freshly prefilled batch to a running one (continuous batching), in place.

        The narrower batch is padded on the left, in its attention mask and its KV cache alike; every row
        carries its own positions, so padding never shifts a token.
        """
        width = max(state.attention_mask.shape[1], joining.attention_mask.shape[1])
        a, b = _kv(state.cache), _kv(joining.cache)
        merged = [
            tuple(torch.cat([_left_pad(x, width, 2), _left_pad(y, width, 2)]) for x, y in zip(pa, pb, strict=True))
            for pa, pb in zip(a, b, strict=True)
        ]
        _set_kv(state.cache, merged)
        masks = [_left_pad(state.attention_mask, width, 1), _left_pad(joining.attention_mask, width, 1)]
        state.attention_mask = torch.cat(masks)
        state.seq_ids = state.seq_ids + joining.seq_ids
        state.positions = torch.cat([state.positions, joining.positions])
        state.tokens = torch.cat([state.tokens, joining.tokens])
        state.logprobs = torch.cat([state.logprobs, joining.logprobs])
        state.sampler = state.sampler.cat(joining.sampler)
        state.adapters = state.adapters + joining.adapters

    @torch.inference_mode()
    def load_weights_from_disk(self, model_path: str) -> None:
        """Load every tensor of a Hugging Face checkpoint directory into the running model."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_path}")
        state = {}
        for f in files:
            state.update(load_file(f))
        self.load_tensors(state)
        self.model_path = model_path

    @contextlib.contextmanager
    def _adapters(self, adapters: list[str | None]):
        """Name each row's adapter to PEFT's LoRA layers for one forward (their ``adapter_names``, as PEFT's own
        ``PeftModel.forward(adapter_names=...)`` passes it); with no LoRA layer in the model, nothing to do."""
        names = ["__base__" if a is None else a for a in adapters]
        hooks = [
            layer.register_forward_pre_hook(
                lambda _, args, kw: (args, {**kw, "adapter_names": names}), with_kwargs=True
            )
            for layer in self.adapter_layers
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    @torch.inference_mode()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy named tensors into the model's parameters; a name the model lacks is an error."""
        params = self.parameter_specs()
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise KeyError(f"the model has no parameter(s) {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        for name, value in tensors.items():
            target = params[name]
            if target.shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} does not match the model's {tuple(target.shape)}")
            target.copy_(value.to(target.dtype))

    def parameter_specs(self) -> dict[str, torch.Tensor]:
        """The base model's parameters by their Hugging Face names: where PEFT wrapped a layer for LoRA, its
        ``base_layer`` under the layer's own name, and no adapter tensor."""
        return {k.replace(".base_layer.", "."): v for k, v in self.model.state_dict().items() if ".lora_" not in k}


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _set_kv(cache, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for i, (k, v) in enumerate(pairs):
        if hasattr(cache, "layers"):
            cache.layers[i].keys, cache.layers[i].values = k, v
        else:
            cache.key_cache[i], cache.value_cache[i] = k, v


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
