"""Every RPC request and reply: small dataclasses, registered by name in one explicit dict.

A message may only hold the field types ``fields.py`` lists (checked when it is registered), so the
decoder can check every field of an incoming frame against these annotations. Modules outside ``rpc/``
register their own messages with ``@register``; names must be unique.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
from typing import TypeVar

import torch

from hpcrl.rpc.fields import check_annotation, field_types

MESSAGES: dict[str, type] = {}
T = TypeVar("T", bound=type)


def register(cls: T) -> T:
    """Add a dataclass to MESSAGES under its class name, after checking its field annotations."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"only dataclasses can be RPC messages, got {cls!r}")
    if MESSAGES.get(cls.__name__, cls) is not cls:
        raise ValueError(f"an RPC message named {cls.__name__} is already registered ({MESSAGES[cls.__name__]!r})")
    known = lambda c: c is cls or MESSAGES.get(c.__name__) is c  # noqa: E731
    for name, ann in field_types(cls).items():
        check_annotation(ann, f"{cls.__name__}.{name}", known)
    MESSAGES[cls.__name__] = cls
    return cls


# --- generic --------------------------------------------------------------------------------------------


@register
@dataclasses.dataclass
class Ack:
    """An empty reply (and the body of ``shutdown``)."""


@register
@dataclasses.dataclass
class Ping:
    """Liveness probe; the reply is a Pong."""


@register
@dataclasses.dataclass
class Pong:
    rank: int  # the replying worker's rank in its group
    pid: int  # its process id, to match log files and process trees


@register
@dataclasses.dataclass
class Echo:
    tensors: list[torch.Tensor]  # returned unchanged: a transport test and benchmark
    note: str  # free text, returned unchanged


@register
@dataclasses.dataclass
class ErrorReply:
    rank: int  # rank of the worker that failed
    method: str  # the RPC method that was called
    error_type: str  # exception class name, or the protocol error (AuthError, DecodeError, ...)
    message: str  # str() of the exception: what went wrong
    traceback: str  # formatted remote traceback; empty for protocol errors


@register
@dataclasses.dataclass
class Welcome:
    """A server's answer to a connection's hello with the right token (``transport.py``)."""

    rank: int  # the server's rank in its group
    methods: list[str]  # every method it takes, ``shutdown`` included, sorted
    max_body_bytes: int  # the largest request body it reads


# --- trainer --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SequenceData:
    """One sequence as the controller builds it; a batch of them travels packed, as a SequenceBatch."""

    input_ids: list[int]  # prompt + completion token ids
    loss_mask: list[int]  # 1 where the token is trained on (completion), 0 elsewhere; same length
    advantage: float  # the sequence's advantage, broadcast to its tokens
    old_logprobs: list[float] | None  # behaviour-policy logprob per token (the server's; the trainer's: recompute)
    prox_logprobs: list[float] | None  # proximal-policy logprob per token (decoupled PPO), if computed
    ref_logprobs: list[float] | None  # reference-model logprob per token, for a KL term
    versions: list[int] | None  # weight version that generated each token; None for prompt-only data
    token_advantages: list[float] | None = None  # per-token advantage (GAE); None: ``advantage`` for every token
    returns: list[float] | None = None  # per-token GAE return, the critic's target (PPO with a critic)
    old_values: list[float] | None = None  # per-token value from the critic before its update (value clipping)


# SequenceBatch's per-token tensors: (field, dtype, array typecode). Token ids and versions fit in int32
# (vocabularies and version counters are far below 2**31); logprobs travel as float32, the precision the
# trainer computes them in (its MicroBatch tensors are float32), so a float32 value arrives bit for bit.
_PER_TOKEN = (
    ("input_ids", torch.int32, "i"),
    ("loss_mask", torch.bool, "b"),
    ("old_logprobs", torch.float32, "f"),
    ("prox_logprobs", torch.float32, "f"),
    ("ref_logprobs", torch.float32, "f"),
    ("versions", torch.int32, "i"),
    ("token_advantages", torch.float32, "f"),
    ("returns", torch.float32, "f"),
    ("old_values", torch.float32, "f"),
)
_OPTIONAL = ("old_logprobs", "prox_logprobs", "ref_logprobs", "versions", "token_advantages", "returns", "old_values")


@register
@dataclasses.dataclass
class SequenceBatch:
    """Sequences packed into flat tensors, token after token: sequence i holds the ``lengths[i]`` tokens that
    start at ``sum(lengths[:i])`` of every per-token tensor. Its raw bytes travel outside the JSON header, so a
    train step's batch costs one memcpy a field instead of a JSON number a token. Build it with ``pack``; the
    receiver gets the same sequences back with ``unpack``. Checked on construction, so a malformed frame is
    refused by the decoder naming the field."""

    lengths: torch.Tensor  # int64 [N]: tokens of each sequence, >= 0
    input_ids: torch.Tensor  # int32 [sum(lengths)]: every sequence's prompt + completion token ids
    loss_mask: torch.Tensor  # bool [sum(lengths)]: True where the token is trained on
    advantages: torch.Tensor  # float64 [N]: each sequence's advantage (a Python float, kept exactly)
    old_logprobs: torch.Tensor | None  # float32 [sum(lengths)], or None when no sequence has them
    prox_logprobs: torch.Tensor | None  # float32 [sum(lengths)], or None
    ref_logprobs: torch.Tensor | None  # float32 [sum(lengths)], or None
    versions: torch.Tensor | None  # int32 [sum(lengths)]: weight version per token (-1 on prompts), or None
    token_advantages: torch.Tensor | None = None  # float32 [sum(lengths)]: GAE advantage per token, or None
    returns: torch.Tensor | None = None  # float32 [sum(lengths)]: GAE return per token (the critic's target), or None
    old_values: torch.Tensor | None = None  # float32 [sum(lengths)]: the critic's values before its update, or None

    def __post_init__(self) -> None:
        _check_tensor(self.lengths, "lengths", torch.int64, None)
        if self.lengths.numel() and int(self.lengths.min()) < 0:
            raise ValueError(f"lengths: must be >= 0, got {int(self.lengths.min())}")
        total = int(self.lengths.sum())
        _check_tensor(self.advantages, "advantages", torch.float64, len(self.lengths))
        for name, dtype, _ in _PER_TOKEN:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                _check_tensor(value, name, dtype, total)

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def pack(cls, sequences: list[SequenceData]) -> SequenceBatch:
        """Every sequence's fields, concatenated; raises ValueError naming the sequence and field that do not fit."""
        for i, seq in enumerate(sequences):
            _check_sequence(seq, i)
        fields = {}
        for name, dtype, code in _PER_TOKEN:
            if name in _OPTIONAL and _absent(sequences, name):
                fields[name] = None
                continue
            values = list(itertools.chain.from_iterable(getattr(s, name) for s in sequences))  # faster than a generator
            try:
                flat = array.array(code, values)
            except (TypeError, OverflowError) as e:
                raise ValueError(f"{name}: a value does not fit {dtype} ({type(e).__name__}: {e})") from None
            fields[name] = _from_array(flat, dtype)
        advantages = array.array("d", [s.advantage for s in sequences])
        lengths = array.array("q", [len(s.input_ids) for s in sequences])
        return cls(_from_array(lengths, torch.int64), advantages=_from_array(advantages, torch.float64), **fields)

    def unpack(self) -> list[SequenceData]:
        """The sequences ``pack`` was given, in order: the same ids, mask, advantages and versions, and
        logprobs as float32 values (which every logprob from an inference server already is)."""
        bounds = list(itertools.accumulate(self.lengths.tolist(), initial=0))
        columns = {name: _to_list(getattr(self, name)) for name, _, _ in _PER_TOKEN}
        return [
            SequenceData(
                advantage=advantage,
                **{name: None if c is None else c[start:end] for name, c in columns.items()},
            )
            for start, end, advantage in zip(bounds[:-1], bounds[1:], self.advantages.tolist(), strict=True)
        ]


def _check_tensor(value: object, name: str, dtype: torch.dtype, numel: int | None) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(value).__name__}")
    if value.dtype != dtype or value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D {dtype} tensor, got {value.dim()}-D {value.dtype}")
    if numel is not None and value.numel() != numel:
        raise ValueError(f"{name}: has {value.numel()} entries, expected {numel} (from lengths)")


def _check_sequence(seq: SequenceData, index: int) -> None:
    if not isinstance(seq, SequenceData):
        raise ValueError(f"sequence {index}: expected SequenceData, got {type(seq).__name__}")
    if isinstance(seq.advantage, bool) or not isinstance(seq.advantage, int | float):
        raise ValueError(f"sequence {index}: advantage must be a float, got {type(seq.advantage).__name__}")
    for name, _, _ in _PER_TOKEN:
        value = getattr(seq, name)
        if value is None and name in _OPTIONAL:
            continue
        if not isinstance(value, list | tuple) or len(value) != len(seq.input_ids):
            got = f"{len(value)} entries" if isinstance(value, list | tuple) else type(value).__name__
            raise ValueError(f"sequence {index}: {name} must be a list as long as input_ids, got {got}")
    try:
        mask_values = set(seq.loss_mask)
    except TypeError:  # an unhashable entry
        mask_values = {None}
    if not mask_values <= {0, 1}:  # a float 1.0 passes here and is refused by the int8 array
        raise ValueError(f"sequence {index}: loss_mask values must be 0 or 1")


def _absent(sequences: list[SequenceData], name: str) -> bool:
    """True when no sequence has the optional field; refused when only some do (a batch packs one tensor)."""
    present = [getattr(s, name) is not None for s in sequences]
    if any(present) and not all(present):
        raise ValueError(f"sequence {present.index(False)}: has no {name} while others have it; set it on all or none")
    return not any(present)


def _from_array(values: array.array, dtype: torch.dtype) -> torch.Tensor:
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=torch.uint8).view(dtype)  # shares the array's memory, keeps it alive


def _to_list(t: torch.Tensor | None) -> list | None:
    if t is None:
        return None
    return (t.to(torch.int8) if t.dtype == torch.bool else t).tolist()


@register
@dataclasses.dataclass
class TrainStep:
    batch: SequenceBatch  # this rank's shard of the batch
    temperature: float  # sampling temperature the logits are divided by
    export_to: str = ""  # after the update, the weights for the servers go here (ExportWeights' export); "" = none


@register
@dataclasses.dataclass
class TrainStepResult:
    metrics: dict[str, float]  # loss, grad norm, clip fraction, ... reduced over ranks


@register
@dataclasses.dataclass
class ComputeLogprobs:
    batch: SequenceBatch  # this rank's shard
    temperature: float  # sampling temperature the logits are divided by


@register
@dataclasses.dataclass
class LogprobsResult:
    """Per-token logprobs of each sequence, in request order, as one flat float32 tensor (raw bytes on the
    wire, like ``SequenceBatch``): sequence i's ``lengths[i]`` values start at ``sum(lengths[:i])``."""

    lengths: torch.Tensor  # int64 [N]
    values: torch.Tensor  # float32 [sum(lengths)]

    def __post_init__(self) -> None:
        _check_tensor(self.lengths, "lengths", torch.int64, None)
        _check_tensor(self.values, "values", torch.float32, int(self.lengths.sum()))

    @classmethod
    def of(cls, logprobs: list[list[float]]) -> LogprobsResult:
        flat = array.array("f", itertools.chain.from_iterable(logprobs))
        lengths = array.array("q", [len(row) for row in logprobs])
        return cls(_from_array(lengths, torch.int64), _from_array(flat, torch.float32))

    def per_sequence(self) -> list[list[float]]:
        values = self.values.tolist()
        bounds = list(itertools.accumulate(self.lengths.tolist(), initial=0))
        return [values[start:end] for start, end in itertools.pairwise(bounds)]


@register
@dataclasses.dataclass
class ComputeValues:
    """The critic's per-token values of this rank's shard, entry t the value of the state token t was chosen in."""

    batch: SequenceBatch  # this rank's shard


@register
@dataclasses.dataclass
class ValuesResult(LogprobsResult):
    """The critic's per-token values of each sequence, in request order, laid out as ``LogprobsResult``."""


@register
@dataclasses.dataclass
class ExportWeights:
    path: str  # directory to write the Hugging Face layout (safetensors + config) into


@register
@dataclasses.dataclass
class SaveCheckpoint:
    path: str  # directory for the sharded checkpoint (model, optimizer, step)


@register
@dataclasses.dataclass
class LoadCheckpoint:
    path: str  # directory written earlier by SaveCheckpoint


@register
@dataclasses.dataclass
class HostWeightGroup:
    """Trainer rank 0 starts the weight-update group's rendezvous on its own node and says where."""

    timeout_s: float  # how long the group waits for its members, and then for each broadcast


@register
@dataclasses.dataclass
class WeightGroupAddress:
    master_address: str  # trainer rank 0's own host, as the servers dial it ("" from the other ranks)
    master_port: int  # the port its rendezvous listens on, from rank 0's own port slice (0 from the others)
    backend: str  # what rank 0 sends over: nccl (trainers on CUDA) or gloo ("" from the other ranks)


@register
@dataclasses.dataclass
class JoinWeightGroup:
    world_size: int  # trainer rank 0 plus every tensor-parallel rank of every inference server
    group_name: str  # name shared with the inference servers
    timeout_s: float  # how long rank 0 waits for every server rank to join, and then for each broadcast


@register
@dataclasses.dataclass
class PushWeights:
    weight_version: int  # version number the servers report after this push
    dtype: str  # the servers' dtype (e.g. "bfloat16"): floating-point tensors are sent as it


@register
@dataclasses.dataclass
class WeightSpecsRequest:
    """Ask for the names, dtypes and shapes of the weights a push will send."""

    dtype: str  # the dtype the push sends floating-point tensors as (the servers')


@register
@dataclasses.dataclass
class WeightSpecs:
    names: list[str]  # parameter names in the Hugging Face layout, in push order
    dtypes: list[str]  # torch dtype name per parameter, e.g. "bfloat16"
    shapes: list[list[int]]  # full (unsharded) shape per parameter


@register
@dataclasses.dataclass
class TrainerInfo:
    """Ask a trainer rank for its state."""


@register
@dataclasses.dataclass
class TrainerState:
    rank: int  # global rank of the replying trainer
    step: int  # optimizer steps taken so far
