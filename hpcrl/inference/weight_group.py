"""A process group between trainer rank 0 and the inference servers, for pushing weights.

It is a group of its own, outside torch.distributed's default (world) group: trainer rank 0 already
belongs to the trainers' world, and each server rank is its own process. It forms the way SGLang's
``/init_weights_update_group`` forms it (a TCP rendezvous at ``master_address:master_port``, keys
prefixed by the group name, rank 0 = the trainer), so the same trainer code pushes to SGLang on GPUs
(nccl) and to hpcrl's CPU server (gloo).

Ranks and buckets are ``weight_layout.py``'s (no torch there). The rendezvous is on trainer rank 0's node:
it listens first (``host_store``, a port of its own port slice), then reports where.

Tensors go out one ``broadcast`` at a time from rank 0, in the order of the names sent in
``/update_weights_from_distributed``; a receiver allocates a buffer for every tensor of one call before
the first arrives, as SGLang does, so one call's bytes are what a bucket may hold.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

from hpcrl.inference.weight_layout import DEFAULT_GROUP
from hpcrl.net import format_hostport

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout, which SGLang's servers join with


def host_store(host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> TCPStore:
    """Trainer rank 0: start the group's rendezvous store on ``port`` of this node (every interface), before
    the servers are told where it is; ``host`` is this node's own address, which the servers dial."""
    store = TCPStore(
        host,
        port,
        None,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )
    log.info("weight group rendezvous listening on port %d (this node, advertised as %s)", port, host)
    return store


def open_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store: TCPStore | None = None,
) -> dist.ProcessGroup:
    """Join the weight-update group as ``rank`` of ``world_size``; blocks until every member joins.

    Rank 0 passes the ``host_store`` it started (or None: it starts one here); the others dial it."""
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{format_hostport(master_address, master_port)}"
    if store is None:
        # Built here as torch's tcp:// rendezvous builds it (rank 0 hosts it), not through that rendezvous:
        # under torchrun (TORCHELASTIC_USE_AGENT_STORE) it would make rank 0 a client too.
        store = TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True
        )
    group, _ = _new_process_group_helper(
        world_size, rank, [], backend, PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    # torch's collectives translate group ranks through this map; the group's ranks are its own.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    log.info("joined weight group %s at %s as rank %d of %d (%s)", group_name, url, rank, world_size, backend)
    return group


def close_weight_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def send_tensors(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0: broadcast each tensor to every server rank, in order."""
    for tensor in tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def receive_tensors(
    group: dist.ProcessGroup, specs: Sequence[tuple[str, torch.dtype, list[int]]]
) -> dict[str, torch.Tensor]:
    """A server rank: allocate a buffer per (name, dtype, shape), then receive each, in the sender's order."""
    buffers = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in specs}
    for tensor in buffers.values():
        dist.broadcast(tensor, src=0, group=group)
    return buffers


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a wire name such as "bfloat16" (or "torch.bfloat16") names; ValueError otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; expected a torch dtype name such as bfloat16")
    return dtype
