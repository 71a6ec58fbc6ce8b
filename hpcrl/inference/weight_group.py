"""A process group between trainer rank 0 and the inference servers, for pushing weights.

It is a group of its own, outside torch.distributed's default (world) group: trainer rank 0 already
belongs to the trainers' world, and each server is its own process. It forms the way SGLang's
``/init_weights_update_group`` forms it (a TCP rendezvous at ``master_address:master_port``, keys
prefixed by the group name, rank 0 = the trainer), so the same trainer code pushes to SGLang on GPUs
(nccl) and to hpcrl's CPU server (gloo). Tensors then go out one ``broadcast`` at a time from rank 0,
in the order of the names sent in ``/update_weights_from_distributed``.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

from hpcrl.net import format_hostport

log = logging.getLogger(__name__)


def open_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join the weight-update group as ``rank`` of ``world_size``; blocks until every member joins."""
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{format_hostport(master_address, master_port)}"
    # The store is built here, as torch's tcp:// rendezvous builds it (rank 0 hosts it), not through that
    # rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE) it would make rank 0 a client too.
    store = TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True)
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
    """Rank 0: broadcast each tensor to every server, in order."""
    for tensor in tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def receive_tensors(
    group: dist.ProcessGroup, specs: list[tuple[str, torch.dtype, list[int]]]
) -> dict[str, torch.Tensor]:
    """A server: receive one tensor per (name, dtype, shape), in the sender's order."""
    out = {}
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=dtype)
        dist.broadcast(tensor, src=0, group=group)
        out[name] = tensor
    return out
