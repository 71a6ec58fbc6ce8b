"""Sampling parameters as SGLang names them, and the sampler of the CPU server.

Logprobs: the logprob returned for a sampled token is ``log_softmax(logits / temperature)[token]``,
the tempered distribution the token was drawn from, before top-p/top-k truncation. The trainer
computes its logprobs the same way, so with ``top_p=1`` and ``top_k=-1`` (the training defaults) the
behaviour and training logprobs agree exactly. ``temperature=0`` means greedy decoding; its logprobs
are those of the untempered distribution (temperature 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


class RequestError(ValueError):
    """A request the server cannot serve as given; answered with HTTP 400 and this message."""


@dataclass
class SamplingParams:
    max_new_tokens: int = SGLANG_DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1

    @classmethod
    def from_json(cls, data: Any, where: str = "sampling_params") -> SamplingParams:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise RequestError(f"{where} must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(f"{where}: unsupported field(s) {unknown}; hpcrl's CPU server supports {sorted(known)}")
        params = cls(**data)
        if isinstance(params.stop, str):
            params.stop = [params.stop]
        params.check(where)
        return params

    def check(self, where: str) -> None:
        _need(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0, where, "max_new_tokens", "an integer >= 0")
        _need(_is_num(self.temperature) and self.temperature >= 0, where, "temperature", "a number >= 0")
        _need(_is_num(self.top_p) and 0 < self.top_p <= 1, where, "top_p", "a number in (0, 1]")
        _need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), where, "top_k", "-1 or an integer >= 1")
        _need(_is_int(self.n) and self.n >= 1, where, "n", "an integer >= 1")
        ok = isinstance(self.stop_token_ids, list) and all(_is_int(t) for t in self.stop_token_ids)
        _need(ok, where, "stop_token_ids", "a list of token ids")
        _need(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop), where, "stop", "strings")
        _need(isinstance(self.ignore_eos, bool), where, "ignore_eos", "true or false")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _need(ok: bool, where: str, name: str, expected: str) -> None:
    if not ok:
        raise RequestError(f"{where}.{name} must be {expected}")


@dataclass
class BatchSampler:
    """Per-row temperature, top-p and top-k for one batch, as tensors."""

    temperature: torch.Tensor  # [B], 0 = greedy
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B], vocab size where off

    @classmethod
    def of(cls, params: list[SamplingParams], vocab_size: int) -> BatchSampler:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params]),
        )

    def cat(self, other: BatchSampler) -> BatchSampler:
        return BatchSampler(*(torch.cat([a, b]) for a, b in zip(self.tensors(), other.tensors(), strict=True)))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.temperature, self.top_p, self.top_k

    def select(self, keep: torch.Tensor) -> BatchSampler:
        return BatchSampler(self.temperature[keep], self.top_p[keep], self.top_k[keep])

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return (tokens [B], their logprobs [B]) as documented above."""
        logits = logits.float()
        greedy = self.temperature == 0
        scale = torch.where(greedy, torch.ones_like(self.temperature), self.temperature)
        logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
        filtered = _truncate(logprobs, self.top_p, self.top_k)
        drawn = torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator).squeeze(1)
        tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _truncate(logprobs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus with -inf."""
    if bool((top_p >= 1).all()) and bool((top_k >= logprobs.shape[-1]).all()):
        return logprobs
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    ranks = torch.arange(logprobs.shape[-1])[None, :]
    mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()
    drop = (ranks >= top_k[:, None]) | (mass_before >= top_p[:, None])
    drop[:, 0] = False  # the most likely token always stays
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(1, order, sorted_lp)
