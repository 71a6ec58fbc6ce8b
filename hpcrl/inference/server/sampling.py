"""Sampling parameters as SGLang names them, and the sampler of the CPU server.

Logprobs: the logprob returned for a sampled token is ``log_softmax(logits / temperature)[token]``,
the tempered distribution the token was drawn from, before top-p/top-k truncation. The trainer
computes its logprobs the same way, so with ``top_p=1`` and ``top_k=-1`` (the training defaults) the
behaviour and training logprobs agree exactly. ``temperature=0`` means greedy decoding; its logprobs
are those of the untempered distribution (temperature 1).

``sampling_seed`` (SGLang's name; SGLang honours it with ``--enable-deterministic-inference``): a row with a
seed draws its token ``t`` (the ``t``-th this request samples) by the Gumbel-max trick, with one uniform per
vocabulary entry hashed from (seed, t, entry), so the same seed and the same logits give the same tokens
whatever else shares the batch and whatever ran before; SGLang hashes the token's position in the sequence
instead of ``t`` (a continuation of an interrupted request gets its own seed from hpcrl's workflows). Rows
without a seed draw from the server's generator.
"""

from __future__ import annotations

import functools
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
    sampling_seed: int | None = None

    @classmethod
    def from_json(cls, data: Any, where: str = "sampling_params") -> SamplingParams:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise RequestError(f"{where} must be an object, got {type(data).__name__}")
        known = _field_names(cls)
        unknown = sorted(data.keys() - known)
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
        seed = self.sampling_seed
        ok = seed is None or (_is_int(seed) and -(2**63) <= seed < 2**63)
        _need(ok, where, "sampling_seed", "an integer in [-2**63, 2**63 - 1]")


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _need(ok: bool, where: str, name: str, expected: str) -> None:
    if not ok:
        raise RequestError(f"{where}.{name} must be {expected}")


@dataclass
class BatchSampler:
    """Per-row temperature, top-p, top-k and seed for one batch, as tensors."""

    temperature: torch.Tensor  # [B], 0 = greedy
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B], vocab size where off
    seed: torch.Tensor  # [B] int64, the request's sampling_seed (0 where it has none)
    seeded: torch.Tensor  # [B] bool, whether the request sent a sampling_seed
    drawn: torch.Tensor  # [B] int64, tokens the row has sampled so far

    @classmethod
    def of(cls, params: list[SamplingParams], vocab_size: int) -> BatchSampler:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params]),
            seed=torch.tensor([p.sampling_seed or 0 for p in params], dtype=torch.int64),
            seeded=torch.tensor([p.sampling_seed is not None for p in params], dtype=torch.bool),
            drawn=torch.zeros(len(params), dtype=torch.int64),
        )

    def cat(self, other: BatchSampler) -> BatchSampler:
        return BatchSampler(*(torch.cat([a, b]) for a, b in zip(self.tensors(), other.tensors(), strict=True)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_p, self.top_k, self.seed, self.seeded, self.drawn

    def select(self, keep: torch.Tensor) -> BatchSampler:
        return BatchSampler(*(t[keep] for t in self.tensors()))

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return (tokens [B], their logprobs [B]) as documented above."""
        logits = logits.float()
        greedy = self.temperature == 0
        scale = torch.where(greedy, torch.ones_like(self.temperature), self.temperature)
        logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
        filtered = _truncate(logprobs, self.top_p, self.top_k)
        drawn = torch.zeros_like(self.drawn)
        free = ~self.seeded & ~greedy
        if free.any():
            probs = torch.softmax(filtered[free], dim=-1)
            drawn[free] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        seeded = self.seeded & ~greedy
        if seeded.any():
            drawn[seeded] = seeded_draw(filtered[seeded], self.seed[seeded], self.drawn[seeded])
        tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
        self.drawn = self.drawn + 1
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values in [0, 2**32): the
    multipliers are below 2**31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def seeded_uniforms(seed: torch.Tensor, drawn: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` float64 uniforms in (0, 1), a function of (seed, drawn, vocabulary entry) alone."""
    row = _mix32((seed & _M32) ^ _mix32(((seed >> 32) & _M32) ^ 0x9E3779B9))
    row = _mix32(row ^ (drawn & _M32))
    bits = _mix32(_mix32(row[:, None] ^ torch.arange(vocab_size, dtype=torch.int64)[None, :]))
    return (bits.double() + 0.5) / 2.0**32


def seeded_draw(logprobs: torch.Tensor, seed: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(logprobs)`` by the Gumbel-max trick, its noise from ``seeded_uniforms``
    (tokens at -inf, outside top-k/top-p, are never drawn)."""
    gumbel = -torch.log(-torch.log(seeded_uniforms(seed, drawn, logprobs.shape[-1])))
    return (logprobs.double() + gumbel).argmax(dim=-1)


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
