"""Every RPC request and reply: small dataclasses, registered by name in one explicit dict.

A message may only hold the field types ``fields.py`` lists (checked when it is registered), so the
decoder can check every field of an incoming frame against these annotations. Modules outside ``rpc/``
register their own messages with ``@register``; names must be unique.
"""

from __future__ import annotations

import dataclasses
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


# --- trainer --------------------------------------------------------------------------------------------


@register
@dataclasses.dataclass
class SequenceData:
    input_ids: list[int]  # prompt + completion token ids
    loss_mask: list[int]  # 1 where the token is trained on (completion), 0 elsewhere; same length
    advantage: float  # the sequence's advantage, broadcast to its tokens
    old_logprobs: list[float] | None  # behaviour-policy logprob per token (from the inference server)
    prox_logprobs: list[float] | None  # proximal-policy logprob per token (decoupled PPO), if computed
    ref_logprobs: list[float] | None  # reference-model logprob per token, for a KL term
    versions: list[int] | None  # weight version that generated each token; None for prompt-only data


@register
@dataclasses.dataclass
class TrainStep:
    sequences: list[SequenceData]  # this rank's shard of the batch
    temperature: float  # sampling temperature the logits are divided by


@register
@dataclasses.dataclass
class TrainStepResult:
    metrics: dict[str, float]  # loss, grad norm, clip fraction, ... reduced over ranks


@register
@dataclasses.dataclass
class ComputeLogprobs:
    sequences: list[SequenceData]  # this rank's shard
    temperature: float  # sampling temperature the logits are divided by


@register
@dataclasses.dataclass
class LogprobsResult:
    logprobs: list[list[float]]  # per sequence, one logprob per token, in request order


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
