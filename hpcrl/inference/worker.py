"""``python -m hpcrl.inference.worker [--role server|reward_model] [--run-dir DIR] [--rank N]``: one server worker.

What a scheduler runs for each server: the policy's (role ``server``, the default) and the reward model's (role
``reward_model``: ``reward.model.path`` on ``allocation.reward_model``'s backend, ``--is-embedding`` for
``reward.model.kind=discriminative``, no LoRA; its weights never change, so no weight sync ever reaches it; its
resources are ``cluster.roles.reward_model``, else the servers'). The worker:

1. reads the run's ``config.yaml`` (``HPCRL_RUN_DIR`` or ``--run-dir``) and its rank (``HPCRL_RANK`` or ``--rank``);
2. picks its address: a port of its own port slot (``worker_ports``) in ``cluster.net``'s range (for SGLang also
   its ``--nccl-port``, where its ranks meet: ``server_ports``), the host
   it advertises (``cluster.net.advertise_host``, else discovered) and the host it binds
   (``cluster.net.bind_host``, else the wildcard of the advertised address's family);
3. starts the server of ``allocation.server.backend`` (hpcrl's CPU server or SGLang) as its child, whose
   output goes to ``logs/server-proc-<rank>.log`` (the reward model's: ``logs/reward_model-proc-<rank>.log``; the
   worker's own log is ``logs/<role>-<rank>.log``);
4. waits until the server answers /health (``cluster.roles.server.setup_timeout_s``), and only then registers
   ``host:port`` in the run's registry under its role: registered means ready;
5. waits until the server exits (then exits with the server's exit code) or this worker gets SIGTERM or
   SIGINT (then it ends the server's process tree by PID and exits with 128 + the signal).

It holds a lease on its controller (``hpcrl/launch/lease.py``): a small endpoint of its own, on another
port of its slot (registered as ``extra["lease"]``), takes the controller's heartbeat; with none for
``cluster.worker_lease_s`` the worker SIGTERMs itself, and so ends its server as in step 5. Its setup grace ends
at the first heartbeat, not at the controller's first request: those go to the server's HTTP API, another
process, which takes no token.

A server that dies while starting makes the worker exit non-zero with the server's exit code and log tail in
the worker's own log, which the scheduler's ``WorkerFailed`` carries to the controller. Signals are only
recorded while the worker works (spawning, registering) and acted on between steps, so no step is cut short
and the server is never left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from hpcrl.config.errors import ConfigError
from hpcrl.config.load import load_run_config
from hpcrl.config.schema import Config, LoRAConfig, RoleAllocation, RoleResources
from hpcrl.inference.client import InferenceClient, InferenceError
from hpcrl.inference.serve import ServerProcess, start_server, stop_servers
from hpcrl.launch.addresses import port_range, worker_addresses
from hpcrl.launch.lease import Lease
from hpcrl.launch.process import Child, ChildExited
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slots import parse_worker_args, worker_ports
from hpcrl.launch.stacks import watch_stack_requests
from hpcrl.logs import setup_logging
from hpcrl.rpc.auth import read_token
from hpcrl.rundir import RunDir

log = logging.getLogger("hpcrl.inference.worker")

ROLE = "server"
REWARD_MODEL = "reward_model"  # the reward model's servers: the same worker, serving reward.model.path
ROLES = (ROLE, REWARD_MODEL)
TINY_MODEL_DIR = "model"  # where, in the run directory, the controller writes the model of model.source=tiny
_POLL_S = 0.2  # how often a serving worker checks its server and its signals
_STOP_GRACE_S = 10.0  # seconds the server gets between SIGTERM and SIGKILL


class _Stopped(Exception):
    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")


class _Signals:
    """Records SIGTERM and SIGINT instead of raising them, so that no step is interrupted half-way."""

    def __init__(self) -> None:
        self.received: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum

    def check(self) -> None:
        if self.received is not None:
            raise _Stopped(self.received)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def add_role(p: argparse.ArgumentParser) -> None:
        p.add_argument("--role", choices=ROLES, default=ROLE, help="the policy's servers or the reward model's")

    prog, description = "python -m hpcrl.inference.worker", __doc__.splitlines()[0]
    return parse_worker_args(prog, description, "the role's servers", argv, add_role)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signals = _Signals()  # first, so that a signal during start-up is seen, not fatal half-way
    run_dir = RunDir(Path(args.run_dir).absolute())
    setup_logging(args.role, args.rank, "INFO", _own_log_file(run_dir.log_file(args.role, args.rank)))
    try:
        cfg = load_run_config(run_dir.config_file)
    except ConfigError as e:
        log.error("cannot read the run's config: %s", e)
        return 2
    logging.getLogger().setLevel(cfg.run.log_level)
    return serve(cfg, run_dir, args.rank, signals, args.role)


@dataclass(frozen=True)
class Served:
    """What a worker of ``role`` serves, and with what."""

    role: str
    model: Path
    alloc: RoleAllocation
    resources: RoleResources
    lora: LoRAConfig  # the policy's adapters (train.lora); none for the reward model, whose weights never change
    is_embedding: bool  # a discriminative reward model: its score head's route

    @classmethod
    def of(cls, cfg: Config, run_dir: RunDir, role: str) -> Served:
        if role == REWARD_MODEL:
            model = Path(cfg.reward.model.path).expanduser().absolute()
            discriminative = cfg.reward.model.kind == "discriminative"
            alloc, res = cfg.allocation.reward_model, cfg.cluster.roles.get(role) or cfg.cluster.roles[ROLE]
            return cls(role, model, alloc, res, LoRAConfig(), discriminative)
        return cls(
            role, model_path(cfg, run_dir), cfg.allocation.server, cfg.cluster.roles[ROLE], cfg.train.lora, False
        )


def serve(cfg: Config, run_dir: RunDir, rank: int, signals: _Signals, role: str = ROLE) -> int:
    """Start, wait for, register and watch one server of ``role``; returns the worker's exit code."""
    lease = Lease.from_env()  # from the start: loading the model counts against the lease's grace
    watch_stack_requests(run_dir.path, role, rank)  # a hang report asks for every worker's stacks
    served = Served.of(cfg, run_dir, role)
    advertised, bind = worker_addresses(cfg.cluster.net)
    alloc, resources = served.alloc, served.resources
    port, lease_port, nccl_port = server_ports(cfg, alloc.backend)
    log.info("%s %d: %s backend, advertising %s port %d, binding %s", role, rank, alloc.backend, advertised, port, bind)
    server = start_server(
        alloc.backend,
        served.model,
        bind_host=bind,
        advertise_host=advertised,
        port=port,
        log_file=run_dir.log_file(f"{role}-proc", rank),
        inference=cfg.inference,
        tp_size=alloc.tp_size,
        dtype=cfg.model.dtype,
        seed=cfg.run.seed + rank,
        rank=rank,
        env={**cfg.cluster.env, **resources.env},
        nccl_port=nccl_port,
        lora=served.lora,
        is_embedding=served.is_embedding,
        name=role,
    )
    try:
        try:
            asyncio.run(_wait_healthy(server, resources.setup_timeout_s, cfg.inference.health_poll_s, signals))
        except ChildExited as e:
            log.error("the server died while starting: %s", e)
            return _status(e.exit_code) or 1
        except InferenceError as e:
            log.error("the server did not become healthy (its log: %s): %s", server.child.log_file, e)
            return 1
        extra = {"backend": alloc.backend, "server_pid": server.child.pid}
        if lease is not None:
            extra["lease"] = lease.serve(read_token(run_dir.path), bind, lease_port, advertised)
        entry = Entry(role, rank, advertised, port, extra=extra)
        registry = Registry(run_dir.registry)
        registered = registry.register(entry)
        log.info("ready: serving at %s (registered in %s)", entry.address, registered)
        try:
            return _watch(server.child, signals)
        finally:
            registry.unregister_own(entry)  # an entry must not outlive the server it names
    except _Stopped as e:
        log.info("%s: stopping the server", e)
        return 128 + e.signum
    finally:
        stop_servers([server], grace_s=_STOP_GRACE_S)


def server_ports(cfg: Config, backend: str | None = None) -> tuple[int, int, int | None]:
    """The server's port, its lease endpoint's, and for SGLang (``backend``, default ``allocation.server``'s) the
    ``--nccl-port`` its ranks meet at (the TCP store of its torch.distributed setup): all of this worker's own port
    slot, free on this node, which is the server's."""
    ports = worker_ports(port_range(cfg.cluster.net))
    port, lease_port = ports.allocate(2)
    nccl_port = ports.allocate(1)[0] if (backend or cfg.allocation.server.backend) == "sglang" else None
    return port, lease_port, nccl_port


def model_path(cfg: Config, run_dir: RunDir) -> Path:
    """model.path for model.source=local; the run directory's tiny model for model.source=tiny."""
    if cfg.model.source == "local":
        return Path(cfg.model.path)
    path = run_dir.path / TINY_MODEL_DIR
    if not path.is_dir():
        raise FileNotFoundError(
            f"model.source=tiny, but {path} does not exist: the controller makes the tiny model there before "
            "it starts servers; start the run through the controller, or set model.source=local and model.path"
        )
    return path


async def _wait_healthy(server: ServerProcess, timeout_s: float, poll_s: float, signals: _Signals) -> None:
    """``serve.wait_ready`` for one server, also ending the wait when this worker is signalled."""

    def check_alive() -> None:
        signals.check()
        server.child.check_alive()

    async with InferenceClient([server.address]) as client:
        await client.wait_healthy(timeout_s, check_alive=check_alive, poll_s=poll_s)


def _watch(child: Child, signals: _Signals) -> int:
    """Block until the server exits (return its status) or a signal comes (raise ``_Stopped``)."""
    while True:
        signals.check()
        code = child.poll()
        if code is not None:
            log.error("%s", ChildExited(child.name, child.pid, code, child.log_tail(), child.log_file))
            return _status(code)
        time.sleep(_POLL_S)


def _status(code: int) -> int:
    """A child's exit code as this process's exit status: killed by signal N becomes 128 + N, as in a shell."""
    return 128 - code if code < 0 else code


def _own_log_file(path: Path) -> Path | None:
    """``path``, unless stderr already goes there (a scheduler captured it), which would log every line twice."""
    try:
        err, log_file = os.fstat(2), os.stat(path)
    except OSError:
        return path
    return None if (err.st_dev, err.st_ino) == (log_file.st_dev, log_file.st_ino) else path


if __name__ == "__main__":
    raise SystemExit(main())
