"""The server worker started by LocalScheduler: ready means registered and serving; failures come back fast."""

import asyncio
import os
import signal
import sys
import time

import psutil
import pytest

from hpcrl.config.load import dump_config
from hpcrl.config.schema import (
    AllocationConfig,
    ClusterConfig,
    Config,
    InferenceConfig,
    ModelConfig,
    NetConfig,
    RoleAllocation,
    RoleResources,
    RunConfig,
)
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.worker import server_ports
from hpcrl.launch.addresses import port_range
from hpcrl.launch.base import RoleSpec, WorkerFailed
from hpcrl.launch.local import LocalScheduler
from hpcrl.launch.slots import PortSlots
from hpcrl.net import PortAllocator
from hpcrl.rundir import RunDir
from tests.launch.test_local import raises_soon

PARAMS = {"max_new_tokens": 4, "temperature": 0}


def make_run(tmp_path, model_path, servers: int = 1, advertise_host: str = "") -> tuple[Config, RunDir]:
    cfg = Config(
        run=RunConfig(root=str(tmp_path)),
        model=ModelConfig(source="local", path=str(model_path)),
        allocation=AllocationConfig(
            server=RoleAllocation(backend="cpu", workers=servers),
            trainer=RoleAllocation(backend="fsdp", workers=1, gpus_per_worker=0),
        ),
        cluster=ClusterConfig(
            net=NetConfig(advertise_host=advertise_host),
            roles={"server": RoleResources(setup_timeout_s=300), "trainer": RoleResources()},
        ),
        inference=InferenceConfig(health_poll_s=0.2),
    )
    run_dir = RunDir.create(tmp_path, cfg.run.experiment, cfg.run.trial)
    run_dir.write_config(dump_config(cfg))
    return cfg, run_dir


def start_servers(cfg: Config, run_dir: RunDir) -> tuple[LocalScheduler, RoleSpec]:
    spec = RoleSpec(
        "server",
        [sys.executable, "-m", "hpcrl.inference.worker"],
        workers=cfg.allocation.server.workers,
        setup_timeout_s=cfg.cluster.roles["server"].setup_timeout_s,
    )
    slots = PortSlots({"server": spec.workers, "trainer": cfg.allocation.trainer.workers})
    return LocalScheduler(run_dir, slots, port_range(cfg.cluster.net), grace_s=5), spec


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: list[psutil.Process], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p.pid for p in procs if alive(p)], "processes outlived their worker"


def worker_tree(pid: int) -> list[psutil.Process]:
    me = psutil.Process(pid)
    return [me, *me.children(recursive=True)]


def test_server_workers_register_when_serving_and_end_their_servers(tiny_model, tmp_path):
    cfg, run_dir = make_run(tmp_path, tiny_model, servers=2)
    scheduler, spec = start_servers(cfg, run_dir)
    with scheduler:
        group = scheduler.start(spec)
        entries = group.wait_ready()
        assert [e.rank for e in entries] == [0, 1]
        trees = [worker_tree(e.pid) for e in entries]
        assert all(e.extra["server_pid"] in {p.pid for p in tree} for e, tree in zip(entries, trees, strict=True))

        async def generate():
            async with InferenceClient([e.address for e in entries], request_timeout_s=60) as client:
                return [await client.generate([5, 75, 6], PARAMS, server=e.address) for e in entries]

        results = asyncio.run(generate())
        assert [len(r.output_ids) for r in results] == [4, 4]
        assert "[server:0]" in run_dir.log_file("server", 0).read_text()
        assert run_dir.log_file("server-proc", 1).exists()

        # SIGTERM to the worker alone (as a Slurm step's cancel may): it ends its server and says so
        os.kill(entries[1].pid, signal.SIGTERM)
        wait_gone(trees[1])
        # soon, not at once: a leader thread shows as a zombie while the process's other threads still exit, and
        # waitpid reports nothing until they all have (seen in CI)
        err = raises_soon(group.check_alive, timeout_s=15)
        assert isinstance(err, WorkerFailed) and (err.worker, err.exit_code) == (1, 143), err
        assert "stopping the server" in str(err)
        assert [e.rank for e in scheduler.registry.entries("server")] == [0], "a stopped worker unregisters"
    wait_gone(trees[0])


def test_a_bad_model_path_fails_the_wait_fast_with_the_servers_error(tmp_path):
    missing = tmp_path / "no-such-model"
    cfg, run_dir = make_run(tmp_path, missing, advertise_host="127.0.0.1")
    scheduler, spec = start_servers(cfg, run_dir)
    with scheduler:
        group = scheduler.start(spec)
        start = time.monotonic()
        with pytest.raises(WorkerFailed) as err:
            group.wait_ready()
        assert time.monotonic() - start < 120, "must fail when the server dies, not at the 300 s deadline"
    message = str(err.value)
    assert message.startswith("server worker 0 exited with exit code")
    assert "the server died while starting" in message
    assert str(missing) in message  # the server's own error, from its log tail
    assert scheduler.registry.entries("server") == []


@pytest.mark.parametrize("backend", ["sglang", "cpu"])
def test_a_server_takes_its_ports_nccl_port_included_from_its_own_port_slot(monkeypatch, backend):
    """SGLang's --nccl-port (its ranks' TCP store) from the worker's slot, not drawn by SGLang in the run's range."""
    slots = PortSlots({"server": 2, "trainer": 1})
    for name, value in {**slots.env("server"), "HPCRL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    net = NetConfig(port_min=21000, port_max=24000)
    cfg = Config(cluster=ClusterConfig(net=net), allocation=AllocationConfig(server=RoleAllocation(backend=backend)))
    port, lease_port, nccl_port = server_ports(cfg)
    low, high = PortAllocator(port_range(net), rank=slots.slot("server", 1), world_size=slots.world).slice
    mine = [port, lease_port] if backend == "cpu" else [port, lease_port, nccl_port]
    assert len(set(mine)) == len(mine) and all(low <= p < high for p in mine)
    assert (nccl_port is None) == (backend == "cpu")  # the CPU server's ranks meet over pipes


def test_the_worker_serves_the_role_it_is_told_the_policys_servers_by_default():
    from hpcrl.inference.worker import parse_args

    assert parse_args(["--role", "reward_model", "--run-dir", "/r", "--rank", "2"]).role == "reward_model"
    assert parse_args(["--run-dir", "/r", "--rank", "0"]).role == "server"
    with pytest.raises(SystemExit):
        parse_args(["--role", "critic", "--run-dir", "/r", "--rank", "0"])
