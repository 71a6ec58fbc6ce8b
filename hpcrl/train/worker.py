"""``torchrun ... python -m hpcrl.train.worker [--run-dir D] [--role trainer|critic]``: one trainer or critic rank.

It reads the run's config from the run directory, sets up the FSDP2 engine (the policy; ``--role critic``: the
value model of ``value_engine.py``, from ``model.critic_path`` or the policy's weights), serves the trainer RPC
(``service.py``; the critic's: ``critic_service.py``) on a port of its own slot (a trainer's rank 0 hosts the
weight-update group's rendezvous on another port of that slot, on this node, when asked), registers
``host:port`` in the run's registry (which tells the controller it is ready) and serves until the controller
sends ``shutdown``. It holds a lease on the controller (an endpoint of its own on another port,
``hpcrl/launch/lease.py``): with no heartbeat for ``cluster.worker_lease_s`` (its setup grace over at the
controller's first RPC connection) the rank SIGTERMs itself, and torchrun then ends the other ranks. torch is
imported late so argument errors come back at once.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

log = logging.getLogger("hpcrl.train.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=os.environ.get("HPCRL_RUN_DIR"), help="the run directory")
    parser.add_argument("--role", choices=("trainer", "critic"), default="trainer", help="the policy or the critic")
    args = parser.parse_args(argv)
    if not args.run_dir:
        parser.error("--run-dir (or HPCRL_RUN_DIR) is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    from hpcrl.gc_freeze import freeze_startup_heap, pause_until_frozen

    pause_until_frozen()  # start-up allocates what lives until exit: no collection walks it (gc_freeze.py)
    from hpcrl.logs import setup_logging

    setup_logging(args.role, rank)
    from hpcrl.launch.lease import Lease

    lease = Lease.from_env()  # from the start: setting up counts against the lease's grace
    import torch
    import torch.distributed as dist

    from hpcrl.config.load import load_run_config
    from hpcrl.denormals import flush_denormals
    from hpcrl.launch.addresses import port_range, worker_addresses
    from hpcrl.launch.registry import Entry, Registry
    from hpcrl.launch.slots import worker_ports
    from hpcrl.launch.stacks import watch_stack_requests
    from hpcrl.rpc.auth import read_token
    from hpcrl.rpc.server import RpcServer
    from hpcrl.rundir import RunDir
    from hpcrl.train.critic_service import CriticService
    from hpcrl.train.dist import collective_timeout_s, init_distributed
    from hpcrl.train.service import TrainerService

    flushed = flush_denormals()  # before any thread starts, each inheriting it: subnormals slowed a seed's updates 2.5x
    run_dir = RunDir(Path(args.run_dir))
    watch_stack_requests(run_dir.path, args.role, rank)  # a hang report asks for every rank's stacks
    cfg = load_run_config(run_dir.config_file)
    logging.getLogger().setLevel(cfg.run.log_level)
    info = init_distributed(timeout_s=collective_timeout_s(cfg.cluster.hang_timeout_s))
    try:
        engine = _engine(args.role, cfg, info)
        engine.setup()
        reference = _reference(cfg, engine, info) if args.role == "trainer" else None
        advertised, bind = worker_addresses(cfg.cluster.net)
        # this rank's own port slice: its RPC port, and on rank 0 the weight-update group's rendezvous
        ports = worker_ports(port_range(cfg.cluster.net))
        port = ports.allocate(1)[0]
        on_gpu = info.device.type == "cuda"
        if args.role == "critic":
            service = CriticService(engine, cfg, rank)
        else:
            service = TrainerService(engine, cfg, rank, reference, weight_host=advertised, ports=ports)
        server = RpcServer(
            service.handlers(),
            read_token(run_dir.path),
            rank,
            host=bind,
            port=port,
            advertise_host=advertised,
            thread_init=(lambda: torch.cuda.set_device(info.device)) if on_gpu else None,
            on_authenticated=lease.contact if lease else None,  # the controller's first call ends the setup grace
        )
        server.start_in_thread()
        token = read_token(run_dir.path)
        extra = {"lease": lease.serve(token, bind, ports.allocate(1)[0], advertised)} if lease else {}
        entry = Registry(run_dir.registry).register(Entry(args.role, rank, advertised, port, extra=extra))
        threads = torch.get_num_threads()
        denormals = "subnormals flushed to zero" if flushed else "subnormals computed"
        log.info(
            "ready: trainer RPC at %s (registered in %s; %d torch threads, %s)",
            server.address,
            entry,
            threads,
            denormals,
        )
        freeze_startup_heap(args.role)
        server.serve_until_stopped()
        log.info("shut down by the controller")
    finally:
        dist.destroy_process_group()
    return 0


def _engine(role: str, cfg, info):
    """The rank's engine: the policy's, or the critic's value model (from model.critic_path, else the policy)."""
    from hpcrl.train.engine import Engine
    from hpcrl.train.value_engine import ValueEngine

    if role == "critic":
        path = cfg.model.critic_path or cfg.model.path
        return ValueEngine(path, cfg.train, cfg.model.dtype, info, **_schedule(cfg))
    return Engine(cfg.model.path, cfg.train, cfg.model.dtype, info, **_schedule(cfg))


def _reference(cfg, engine, info):
    """The KL penalty's frozen initial policy (``algorithm.kl.coef > 0``, else None): a second engine, sharded like
    the policy; with LoRA the policy's own base, its adapters switched off (no second copy)."""
    from hpcrl.train.engine import Engine
    from hpcrl.train.lora_reference import BaseReference

    if cfg.algorithm.kl.coef <= 0:
        return None
    if engine.lora:
        return BaseReference(engine)
    reference = Engine(cfg.model.path, cfg.train, cfg.model.dtype, info, **_schedule(cfg))
    reference.setup()
    return reference


def _schedule(cfg) -> dict[str, int]:
    """What the LR schedule counts: the run's steps, each ``algorithm.updates_per_batch`` optimizer updates (the
    policy's and the critic's alike: the critic updates on the same minibatches)."""
    return {"total_steps": cfg.run.max_steps, "updates_per_step": cfg.algorithm.updates_per_batch}


if __name__ == "__main__":
    raise SystemExit(main())
