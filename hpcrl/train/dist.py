"""Start torch.distributed for one trainer process: the only place that does.

Under torchrun the world group runs on NCCL when CUDA is available (each rank on GPU ``LOCAL_RANK``),
else on gloo. Beside it every process gets a gloo group for CPU-side metadata (``DistInfo.meta_group``):
micro-batch counts, loss normalisers, metrics and checkpoint barriers go over it, never over the NCCL
world group, whose collectives can hang on nodes whose InfiniBand has no route while TCP still works.

Outside torchrun (no ``RANK`` in the environment) the process becomes a 1-rank gloo world on an
in-process store: no port, no environment variable, so an engine is usable inside a test or a notebook.
This module reads torchrun's variables and sets none; it logs what it read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How much longer than the controller's RPC deadline (cluster.hang_timeout_s) a collective may wait. The controller
# must see a stall first, while every rank is still inside it: then the ranks that are alive answer its stack request
# from where they wait (a collective) and the one that is stuck or stopped does not, which names it. Were the
# collectives to time out first, the live ranks would fail with a gloo/NCCL timeout that names no peer reliably (NCCL's
# watchdog may abort the process), and the controller would blame them. A minute covers the hang report's gathering.
COLLECTIVE_MARGIN_S = 60.0
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the trainer group and the groups it talks over."""

    rank: int  # global rank, 0..world_size-1
    world_size: int  # number of trainer processes
    local_rank: int  # rank on this node; the CUDA device index under NCCL
    device: torch.device  # where the model and batches live
    meta_group: dist.ProcessGroup  # gloo group for CPU-side agreement (counts, barriers)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Join (or, outside torchrun, create) the trainer's process group; return this rank's ``DistInfo``.

    ``backend``: nccl | gloo; None picks nccl when CUDA is available, else gloo. ``timeout_s`` bounds every
    collective, so a rank that died turns into an error on the others instead of a hang. Calling it again
    in a process whose world group exists reuses that group and adds a new meta group.
    """
    read = {name: os.environ.get(name) for name in TORCHRUN_VARS}
    logger.info("torchrun environment read: %s (sets none)", " ".join(f"{k}={v}" for k, v in read.items()))
    under_torchrun = read["RANK"] is not None
    rank, world_size, local_rank = (_env_int(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if not under_torchrun:
        rank, world_size, local_rank = 0, 1, 0
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None (pick by device), got {backend!r}")
    device = _device(backend, local_rank)
    timeout = timedelta(seconds=timeout_s)

    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised with world size {dist.get_world_size()}, but this "
                f"process expects {world_size}; call init_distributed once per process"
            )
        logger.info("reusing the existing %s world group", dist.get_backend())
    elif under_torchrun:
        # env:// reads MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; device_id binds NCCL to our GPU eagerly
        device_id = device if backend == "nccl" else None
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
    else:
        logger.info("not under torchrun (no RANK): starting a 1-rank %s group on an in-process store", backend)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    meta_group = dist.new_group(backend="gloo", timeout=timeout)
    logger.info(
        "rank %d/%d (local %d): world group %s on %s, meta group gloo",
        rank,
        world_size,
        local_rank,
        backend,
        device,
    )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, meta_group=meta_group)


def collective_timeout_s(hang_timeout_s: float) -> float:
    """The deadline of every collective of a trainer or critic rank: the controller's RPC deadline and a margin."""
    return hang_timeout_s + COLLECTIVE_MARGIN_S


def _env_int(name: str) -> int:
    value = os.environ.get(name, "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer (torchrun sets it), got {value!r}") from None


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this node has {count} visible CUDA devices; start at most {count} "
            "ranks per node (torchrun --nproc_per_node) or check CUDA_VISIBLE_DEVICES"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
