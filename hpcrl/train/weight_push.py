"""Push the trainer's weights to the inference servers: from disk, or over a process group.

The controller picks the path by ``train.weight_sync``; the trainer side of each is here, the HTTP side
is the controller's (``InferenceClient``), and on the distributed path the two must run concurrently.
In both, ``n`` is the new weight version the servers report in ``/model_info`` and in every answer.

``disk`` (servers read a directory on a file system they share with trainer rank 0)::

    all trainer ranks:  path = push_to_disk(engine, run_dir / f"weights/step_{n}")    # collective
    controller, after every rank has returned:
                        await client.update_weights_from_disk(str(path), weight_version=n)

  The directory holds the weights only (one ``model.safetensors``): SGLang's loader, and the CPU server's,
  read the ``*.safetensors`` files of ``model_path`` and nothing else there; the config and tokenizer stay
  those the server started with. Nothing overlaps: rank 0 writes into a hidden sibling directory and renames
  it into place before any rank returns, so a request sent too early fails (no weights there yet) instead of
  loading half a model.
  Use a new directory per version: an existing one is replaced, perhaps under a server still reading it;
  delete old ones once every server has answered.

``distributed`` (trainer rank 0 broadcasts to every server rank; SGLang names it the weight update group)::

    once, after Engine.setup():
      all ranks:        addr = host_weight_group(engine, own_host, port)   # rank 0: listens on ``port`` of its
                        (other ranks: None at once)                         # own node, picks the backend
      controller:       world = client.weights_group_world_size()           # 1 + every tensor-parallel rank
      concurrently:     controller  await client.init_weights_update_group(addr.host, addr.port, backend=addr.backend)
                        all ranks   group = join_weight_group(engine, addr, world)  # None on all but rank 0
    each push, in the servers' dtype ``d`` (a bf16 server gets bf16: SGLang allocates what it is sent):
      specs = weight_specs(engine, d)             # any rank, no collective; the same on every rank
      controller:       await client.begin_weight_update()
      concurrently:     controller  for each bucket of specs (weight_group.buckets, a bounded number of bytes):
                                        await client.update_weights_from_distributed(*bucket, weight_version=n)
                        all ranks   push_over_group(engine, group, d)                 # collective
      controller:       await client.end_weight_update()
    at the end (neither call waits for the other):
      controller:       await client.destroy_weights_update_group()
      rank 0:           leave_weight_group(group)

  The concurrent pairs block until the other side arrives: a server joins the group inside its HTTP
  handler, and receives inside its ``/update_weights_from_distributed`` handler, which answers only after
  every tensor of its bucket has arrived and been loaded; rank 0 broadcasts every tensor in order, and each
  broadcast waits for the call whose bucket holds it. The rendezvous is on rank 0's node with a port chosen
  there (from rank 0's own port slice): nothing about it is probed on another host. The backend is rank
  0's to choose, nccl when the trainer is on CUDA, else gloo, and the servers join with the one it reports.

The group lives on the trainer side in the ``WeightGroup`` that ``join_weight_group`` returns to rank 0:
the caller keeps it beside its engine for the run and passes it to every ``push_over_group``.

Order and names: ``weight_specs`` lists every tensor of the model's state dict under its Hugging Face
name (what ``Engine.export_hf`` and ``export_weights`` write and what the server's model calls it), in
state-dict order, except parameters tied to an earlier one (a tied ``lm_head.weight``: loading ties it to
the embedding again).
``push_over_group`` sends exactly these, in this order: the server receives by position.

With LoRA (``train.lora.rank > 0``) the servers take the adapter, not the model: ``push_to_disk`` writes it in
PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``) for ``/load_lora_adapter``, and
``Engine.adapter_tensors`` / ``Engine.adapter_config`` give what ``/load_lora_adapter_from_tensors`` takes. The
weight update group carries full weights only: ``weight_specs`` and ``push_over_group`` refuse a LoRA engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import TCPStore
from torch.distributed.tensor import DTensor

from hpcrl.inference.weight_group import (
    DEFAULT_GROUP,
    DEFAULT_TIMEOUT_S,
    close_weight_group,
    host_store,
    open_weight_group,
    send_tensors,
)

if TYPE_CHECKING:
    from hpcrl.train.dist import DistInfo
    from hpcrl.train.engine import Engine

logger = logging.getLogger(__name__)

# On CUDA, gathers and broadcasts are queued without blocking the CPU; wait for the device once this many
# bytes are queued, so the loop cannot run ahead and hold the whole model in GPU memory at once.
MAX_IN_FLIGHT_BYTES = 1 << 30

Spec = tuple[str, str, list[int]]  # (Hugging Face name, dtype name such as "bfloat16", full shape)


@dataclass(frozen=True)
class GroupHost:
    """Trainer rank 0's rendezvous for the weight update group, listening before anyone is told where."""

    host: str  # rank 0's own address, as the servers dial it
    port: int  # the port its store listens on (every interface of this node)
    backend: str  # nccl | gloo: what rank 0 sends over; the servers join with the same
    store: TCPStore  # listening on ``port``; the group's members rendezvous there


@dataclass(frozen=True)
class WeightGroup:
    """Trainer rank 0's membership of the weight update group (rank 0 of ``world_size``)."""

    group: dist.ProcessGroup
    name: str  # group_name, as the servers know it
    backend: str  # nccl | gloo; the servers must have joined with the same
    world_size: int  # rank 0 plus every server rank
    device: torch.device  # where a tensor must be to go out on this backend


def weight_specs(engine: Engine, dtype: str | torch.dtype | None = None) -> list[Spec]:
    """(name, dtype name, full shape) of each tensor ``push_over_group`` sends, in its order.

    ``dtype`` is the wire dtype of floating-point tensors (None: the master weights' dtype); other tensors
    keep theirs. Local and cheap on any rank: it reads shapes, never gathers, and leaves FSDP's sharding
    alone (``state_dict()`` would reshard this rank alone, and the ranks' next forwards would then
    all-gather different parameters).
    """
    model, _ = engine.require_setup()
    _refuse_lora(engine)
    wire = _wire_dtype(dtype)
    master = _master_dtype(engine)
    return [
        (name, _dtype_name(_send_dtype(tensor, is_param, master, wire)), list(tensor.shape))
        for name, tensor, is_param in _named_tensors(model)
    ]


def push_to_disk(engine: Engine, out_dir: str | Path) -> Path:
    """Write the weights as one ``model.safetensors`` in ``out_dir`` (``Engine.export_weights``: no config or
    tokenizer files, which ``/update_weights_from_disk`` never reads); the directory servers load. Collective.
    With LoRA: the adapter in PEFT's layout, the directory ``/load_lora_adapter``'s ``lora_path`` names."""
    start = time.monotonic()
    path = engine.export_weights(out_dir)
    logger.info("step %d written to %s for the servers in %.1f ms", engine.step, path, 1e3 * (time.monotonic() - start))
    return path


def host_weight_group(
    engine: Engine, host: str, port: int, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> GroupHost | None:
    """Rank 0: start the group's rendezvous on ``port`` of this node and return where it is; others: None.

    ``host`` is this node's own address (the one it advertises), ``port`` one of its own port slice: the
    servers are told both and dial them. ``backend``: nccl | gloo; None picks nccl when the trainer runs on
    CUDA, else gloo. Local and quick: nothing waits for the servers yet (``join_weight_group`` does)."""
    _, info = engine.require_setup()
    if not info.is_main:
        return None
    backend = backend or ("nccl" if info.device.type == "cuda" else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be nccl, gloo or None (pick by device), got {backend!r}")
    if backend == "nccl" and info.device.type != "cuda":
        raise ValueError(f"backend nccl needs the trainer on CUDA, but it runs on {info.device}; use gloo")
    return GroupHost(host, port, backend, host_store(host, port, timeout_s))


def join_weight_group(
    engine: Engine,
    address: GroupHost | None,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> WeightGroup | None:
    """Rank 0: join the weight update group as its rank 0 at the ``host_weight_group`` it started; others:
    None, at once.

    Blocks until every server rank has joined, so the servers' ``/init_weights_update_group`` must be under
    way concurrently. ``timeout_s`` bounds that wait and every later broadcast.
    """
    _, info = engine.require_setup()
    if not info.is_main:
        return None
    if address is None:
        raise ValueError("rank 0 joins at the GroupHost that host_weight_group returned, got None")
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 (rank 0 plus at least one server rank), got {world_size}")
    device = info.device if address.backend == "nccl" else torch.device("cpu")
    group = open_weight_group(
        address.host, address.port, 0, world_size, group_name, address.backend, timeout_s, store=address.store
    )
    return WeightGroup(group=group, name=group_name, backend=address.backend, world_size=world_size, device=device)


def leave_weight_group(group: WeightGroup) -> None:
    """Rank 0: leave the group (local; the servers leave in ``/destroy_weights_update_group``)."""
    close_weight_group(group.group)


@torch.no_grad()
def push_over_group(engine: Engine, group: WeightGroup | None, dtype: str | torch.dtype | None = None) -> int:
    """Send every tensor of ``weight_specs(engine, dtype)`` from rank 0 over ``group``; return how many.

    Collective on ALL trainer ranks: each sharded parameter is all-gathered (``full_tensor()``) by every
    rank, then rank 0 broadcasts it and drops it before gathering the next, so no rank holds more than one
    full tensor at a time (on CUDA, at most ``MAX_IN_FLIGHT_BYTES`` queued). Rank 0 passes the group that
    ``join_weight_group`` returned, the others None. Every rank raises if that is not so.
    """
    model, info = engine.require_setup()
    _refuse_lora(engine)  # the same on every rank: all raise together, before any collective
    _agree_on_membership(info, group)
    wire = _wire_dtype(dtype)
    master = _master_dtype(engine)
    _reshard(model)  # every rank at once: afterwards every parameter is its sharded DTensor
    start, sent, queued = time.monotonic(), 0, 0
    tensors = _named_tensors(model)
    for _, tensor, is_param in tensors:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # the all-gather
        out_dtype = _send_dtype(tensor, is_param, master, wire)
        if group is not None:
            full = full.detach().to(device=group.device, dtype=out_dtype)
            send_tensors(group.group, [full])
            sent += full.numel() * full.element_size()
        queued += full.numel() * full.element_size()
        del full
        if queued >= MAX_IN_FLIGHT_BYTES:
            _wait_for_device(info.device)
            queued = 0
    _wait_for_device(info.device)
    if group is not None:
        elapsed = time.monotonic() - start
        logger.info(
            "step %d: pushed %d tensors (%.1f MB) over %s in %.2f s",
            engine.step,
            len(tensors),
            sent / 1e6,
            group.name,
            elapsed,
        )
    return len(tensors)


def _named_tensors(model: nn.Module) -> list[tuple[str, Tensor, bool]]:
    """(name, tensor, is_parameter) in ``state_dict()`` order, skipping parameters tied to an earlier name.

    Walks the modules the way ``state_dict()`` does (own parameters, then persistent buffers, then children)
    without running its pre-hooks, so it has no side effect on FSDP's sharding state.
    """
    seen: set[int] = set()
    out: list[tuple[str, Tensor, bool]] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) not in seen:  # a tied copy (lm_head) is loaded by tying, not sent
                seen.add(id(param))
                out.append((dot + name, param, True))
        for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
            if name not in module._non_persistent_buffers_set:
                out.append((dot + name, buffer, False))
    return out


def _master_dtype(engine: Engine) -> torch.dtype:
    """The dtype of the optimizer's parameters: always the sharded master weights, never FSDP's compute copies.

    After a forward FSDP2 leaves the root's parameters unsharded, in the mixed-precision compute dtype;
    the optimizer still holds the sharded ones, which are what ``full_tensor()`` gathers.
    """
    assert engine.optimizer is not None
    return next(p.dtype for g in engine.optimizer.param_groups for p in g["params"])


def _send_dtype(tensor: Tensor, is_param: bool, master: torch.dtype, wire: torch.dtype | None) -> torch.dtype:
    own = master if is_param else tensor.dtype
    return wire if wire is not None and own.is_floating_point else own


def _wire_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return None
    resolved = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."), None)
    if not (isinstance(resolved, torch.dtype) and resolved.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch dtype such as 'bfloat16' or None, got {dtype!r}")
    return resolved


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _agree_on_membership(info: DistInfo, group: WeightGroup | None) -> None:
    """Every rank learns whether exactly rank 0 holds the group, before the first gather could hang."""
    mine_ok = (group is not None) == info.is_main
    ok = torch.tensor([int(mine_ok)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=info.meta_group)
    if ok.item():
        return
    expected = "the WeightGroup from join_weight_group" if info.is_main else "None"
    culprit = f"this rank ({info.rank}) passed {'None' if group is None else 'a WeightGroup'}" if not mine_ok else ""
    raise ValueError(
        "push_over_group takes the WeightGroup from join_weight_group on rank 0 and None on every other rank; "
        + (f"{culprit}, expected {expected}" if culprit else "another rank passed the wrong one")
        + ". Join on rank 0 first, concurrently with the servers' /init_weights_update_group"
    )


def _refuse_lora(engine: Engine) -> None:
    if engine.lora:
        raise ValueError(
            "train.lora: the servers take the adapter, not the full weights over the weight update group; send "
            "Engine.adapter_tensors() with /load_lora_adapter_from_tensors, or push_to_disk for /load_lora_adapter"
        )


def _wait_for_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
