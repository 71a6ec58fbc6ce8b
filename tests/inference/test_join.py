"""``python -m hpcrl.inference.join``: a server joins a running run under a rank of its own, held by the run's lease."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from hpcrl.config.load import dump_config, load_run_config
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
    TrainConfig,
)
from hpcrl.inference import join
from hpcrl.launch.claims import Claim, claim_first_free, claim_path, try_claim
from hpcrl.launch.controller_file import process_started, read_controller_file, write_controller_file
from hpcrl.launch.lease import Lease, LeaseKeeper
from hpcrl.launch.registry import Registry
from hpcrl.launch.slots import PortSlots, worker_ports
from hpcrl.rpc.auth import create_token
from hpcrl.rundir import RunDir

SLOTS = PortSlots({"server": 2, "trainer": 1}, rendezvous=("trainer",))  # controller 0, servers 1-2, trainer 3, rdzv 4
RANGE = (21000, 21500)


def make_cfg(tmp_path, model_path="unused", min_workers: int | None = 1, **train) -> Config:
    return Config(
        run=RunConfig(root=str(tmp_path)),
        model=ModelConfig(source="local", path=str(model_path)),
        allocation=AllocationConfig(
            server=RoleAllocation(backend="cpu", workers=2, min_workers=min_workers),
            trainer=RoleAllocation(backend="fsdp", workers=1, gpus_per_worker=0),
        ),
        train=TrainConfig(**train),
        cluster=ClusterConfig(
            net=NetConfig(advertise_host="127.0.0.1", port_min=RANGE[0], port_max=RANGE[1]),
            roles={"server": RoleResources(setup_timeout_s=120), "trainer": RoleResources()},
        ),
        inference=InferenceConfig(health_poll_s=0.2),
    )


def make_run(cfg: Config) -> RunDir:
    run_dir = RunDir.create(cfg.run.root, cfg.run.experiment, cfg.run.trial)
    run_dir.write_config(dump_config(cfg))
    return run_dir


def run_config(run_dir: RunDir) -> Config:
    """The run's config as the command reads it: checked, its defaults resolved (allocation.server.nodes)."""
    return load_run_config(run_dir.config_file)


def dead_process() -> tuple[int, float]:
    """The pid and start time of a process that has ended."""
    child = subprocess.Popen(["sleep", "30"])
    started = process_started(child.pid)
    child.kill()
    child.wait()
    return child.pid, started


def write_claim(run_dir: RunDir, rank: int, pid: int, started: float, host: str | None = None) -> None:
    claim = Claim("server", rank, pid, host or socket.gethostname(), started, f"token{rank}")
    path = claim_path(run_dir.path / join.JOINS, "server", rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(claim.__dict__))


# -- rank claims


def test_join_claims_give_two_joiners_different_ranks_past_the_runs_own(tmp_path):
    run_dir = make_run(make_cfg(tmp_path))
    first, second = (join.claim_rank(run_dir, 2, None) for _ in range(2))
    assert (first.rank, second.rank) == (2, 3)
    held = json.loads((run_dir.path / "joins" / "server-2").read_text())
    assert (held["pid"], held["host"], held["rank"]) == (os.getpid(), socket.gethostname(), 2)


def _claim_in_child(directory, queue, done) -> None:
    queue.put(claim_first_free(directory, "server", 4).rank)
    done.wait(30)  # a joiner holds its rank while it lives: one that has ended leaves a claim others take over


def test_join_claims_made_at_once_by_many_processes_are_all_distinct(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue, done = ctx.Queue(), ctx.Event()
    children = [ctx.Process(target=_claim_in_child, args=(tmp_path, queue, done)) for _ in range(6)]
    for child in children:
        child.start()
    ranks = sorted(queue.get(timeout=30) for _ in children)
    done.set()
    for child in children:
        child.join(30)
    assert ranks == [4, 5, 6, 7, 8, 9]


def test_join_takes_over_a_claim_whose_process_ended_on_this_node(tmp_path):
    run_dir = make_run(make_cfg(tmp_path))
    pid, started = dead_process()
    write_claim(run_dir, 2, pid, started)
    write_claim(run_dir, 3, os.getpid(), started - 100)  # a live pid, but another process's: the kernel reused it
    write_claim(run_dir, 4, os.getpid(), process_started(os.getpid()))  # live: kept
    assert [join.claim_rank(run_dir, 2, None).rank for _ in range(3)] == [2, 3, 5]
    assert json.loads((run_dir.path / "joins" / "server-2").read_text())["pid"] == os.getpid()


def test_join_never_takes_over_a_claim_of_another_node_nor_one_another_process_is_taking_over(tmp_path):
    run_dir = make_run(make_cfg(tmp_path))
    pid, started = dead_process()
    write_claim(run_dir, 2, pid, started, host="some-other-node")  # cannot be told dead from here
    write_claim(run_dir, 3, pid, started)
    (run_dir.path / "joins" / ".server-3.token3.taken").touch()  # another joiner won the takeover of this claim
    assert try_claim(run_dir.path / "joins", "server", 2)[0] is False
    assert try_claim(run_dir.path / "joins", "server", 3)[0] is False
    assert join.claim_rank(run_dir, 2, None).rank == 4


def test_join_rank_given_must_be_past_the_runs_own_and_free(tmp_path):
    run_dir = make_run(make_cfg(tmp_path))
    with pytest.raises(join.JoinRefused, match=r"--rank 1 is a server of the run's own \(allocation.server.workers=2"):
        join.claim_rank(run_dir, 2, 1)
    write_claim(run_dir, 7, 1, 0.0, host="node9")
    with pytest.raises(join.JoinRefused, match=r"--rank 7 is taken: pid 1 on node9 holds it \(.*joins/server-7\)"):
        join.claim_rank(run_dir, 2, 7)
    assert join.claim_rank(run_dir, 2, 6).rank == 6


# -- refusals


def live_controller_file(run_dir: RunDir, pid: int | None = None, host: str | None = None) -> None:
    write_controller_file(run_dir.path, "c0ffee", 3.0, SLOTS, pid=pid, host=host)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight_sync": "distributed"}, r"^train.weight_sync=distributed: a server joins only a run with .*=disk"),
        ({"min_workers": None}, r"^allocation.server.min_workers is null: the run's fleet is not elastic"),
    ],
)
def test_join_refuses_a_run_whose_settings_take_no_server(tmp_path, kwargs, message):
    cfg = make_cfg(tmp_path, **kwargs)
    run_dir = make_run(make_cfg(tmp_path))
    live_controller_file(run_dir)
    with pytest.raises(join.JoinRefused, match=message):
        join.check_joinable(cfg, run_dir)


def test_join_refuses_a_run_with_no_controller_file_or_a_dead_controller(tmp_path):
    cfg = make_cfg(tmp_path)
    run_dir = make_run(cfg)
    no_controller = f"^no controller is running for {run_dir.path}: "
    with pytest.raises(join.JoinRefused, match=no_controller + "it has no controller-lease.json"):
        join.check_joinable(cfg, run_dir)
    pid, _ = dead_process()
    with pytest.raises(ValueError, match=f"process {pid} does not run"):
        live_controller_file(run_dir, pid=pid)
    live_controller_file(run_dir)
    found = json.loads((run_dir.path / "controller-lease.json").read_text())
    (run_dir.path / "controller-lease.json").write_text(json.dumps({**found, "pid": pid}))
    with pytest.raises(join.JoinRefused, match=no_controller + rf"its controller \(pid {pid} on .*\) has ended"):
        join.check_joinable(cfg, run_dir)
    (run_dir.path / "controller-lease.json").write_text(json.dumps({**found, "pid": pid, "host": "another-node"}))
    assert join.check_joinable(cfg, run_dir).controller == "c0ffee"  # on another node only its lease can tell
    (run_dir.path / "controller-lease.json").write_text("{}")
    with pytest.raises(join.JoinRefused, match=no_controller + ".*controller-lease.json is not a controller file"):
        join.check_joinable(cfg, run_dir)


def test_join_command_refuses_with_one_line_and_exit_2(tmp_path, capsys):
    run_dir = make_run(make_cfg(tmp_path))
    with pytest.raises(SystemExit) as exited:
        join.main([str(run_dir.path)])
    assert exited.value.code == 2
    said = f"hpcrl: no controller is running for {run_dir.path}: it has no controller-lease.json, which its controller "
    assert capsys.readouterr().err == said + "writes as it starts\n"


class _Stopped(Exception):
    pass


def test_join_reads_the_controller_the_job_publishes_before_it_starts_any_worker(tmp_path, monkeypatch):
    from hpcrl.config.hydra import compose_config
    from hpcrl.controller import job

    cfg = compose_config([f"run.root={tmp_path}", "cluster.worker_lease_s=7"])
    run_dir = RunDir.create(tmp_path, cfg.run.experiment, cfg.run.trial)

    def no_scheduler(*args) -> None:
        raise _Stopped

    monkeypatch.setattr(job, "make_scheduler", no_scheduler)
    with pytest.raises(_Stopped):
        job.run_job(cfg, run_dir)
    found = read_controller_file(run_dir.path)
    assert (found.pid, found.host, found.lease_s, found.alive()) == (os.getpid(), socket.gethostname(), 7.0, True)
    assert len(found.controller) == 16
    run = cfg.allocation
    assert found.slot_counts == {"server": run.server.workers, "trainer": run.trainer.workers}
    assert found.slots.world == 1 + run.server.workers + run.trainer.workers + 1  # controller, workers, rendezvous


# -- what the worker gets


def test_join_controller_file_gives_back_the_runs_slots_and_lease(tmp_path):
    live_controller_file(make_run(make_cfg(tmp_path)))
    found = read_controller_file(next(tmp_path.glob("*/*")))
    assert (found.controller, found.lease_s, found.pid, found.host) == (
        "c0ffee",
        3.0,
        os.getpid(),
        socket.gethostname(),
    )
    assert (found.slots.world, found.slots.base("server"), found.slots.rendezvous("trainer")) == (5, 1, 4)
    assert found.alive() is True


def test_join_env_is_a_server_workers_with_its_rank_a_run_slot_and_the_controllers_lease(tmp_path):
    run_dir = make_run(make_cfg(tmp_path))
    live_controller_file(run_dir)
    env = join.join_env(run_config(run_dir), run_dir, read_controller_file(run_dir.path), rank=5)
    assert {k: v for k, v in env.items() if k.startswith("HPCRL_")} == {
        "HPCRL_RUN_DIR": str(run_dir.path),
        "HPCRL_ROLE": "server",
        "HPCRL_RANK": "5",
        "HPCRL_WORLD_SIZE": "2",
        "HPCRL_PORT_SLOT_BASE": "1",
        "HPCRL_PORT_WORLD": "5",
        "HPCRL_PORT_SLOT": "2",  # server rank 5 % 2 = 1's slot: never a slice past the run's, which would overlap
        "HPCRL_CONTROLLER_ID": "c0ffee",
        "HPCRL_LEASE_S": "3",
        "HPCRL_LEASE_GRACE_S": "120",  # cluster.roles.server.setup_timeout_s, as the run's own servers get
    }
    assert env["PATH"] == os.environ["PATH"]  # this process's environment goes on (a Slurm job's GPUs, say)
    assert worker_ports(RANGE, env).slice == SLOTS.allocator(2, RANGE).slice == (21200, 21300)
    lease = Lease.from_env(on_expire=lambda why: None, environ=env)
    lease.stop()
    assert (lease.controller, lease.lease_s) == ("c0ffee", 3.0)


def test_join_slot_of_a_worker_must_lie_in_the_world():
    with pytest.raises(ValueError, match=r"HPCRL_PORT_SLOT=5 is outside 0\.\.4"):
        worker_ports(RANGE, {"HPCRL_PORT_SLOT": "5", "HPCRL_PORT_WORLD": "5", "HPCRL_RANK": "0"})


def test_join_sbatch_script_asks_for_one_server_with_the_roles_slurm_settings(tmp_path):
    cfg = make_cfg(tmp_path)
    server = RoleResources(partition="gpu", qos="high", time_min=90, extra_sbatch=["--requeue"], setup=["module x"])
    setup = ["source ~/venv/bin/activate"]
    cfg.cluster = ClusterConfig(
        kind="slurm", submit_mode="per_role", gpus_per_node=8, roles={"server": server}, setup=setup
    )
    cfg.allocation.server = RoleAllocation(backend="sglang", workers=2, min_workers=1, tp_size=2)
    run_dir = make_run(cfg)
    script = join.sbatch_script(run_config(run_dir), run_dir, "/opt/py/bin/python")
    out = run_dir.path / "logs" / "join-%j.out"
    assert script.splitlines()[3:] == [
        f"#SBATCH --output={out}",
        "#SBATCH --open-mode=append",
        "#SBATCH --job-name=hpcrl-default-join",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --time=90",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --partition=gpu",
        "#SBATCH --qos=high",
        "#SBATCH --requeue",
        "",
        "# cluster.setup",
        "source ~/venv/bin/activate",
        "",
        "# cluster.roles.server.setup",
        "module x",
        "",
        f"exec /opt/py/bin/python -m hpcrl.inference.join {run_dir.path} --rank auto",
    ]


def test_join_sbatch_flag_prints_the_script_of_a_joinable_run(tmp_path, capsys):
    run_dir = make_run(make_cfg(tmp_path))
    live_controller_file(run_dir)
    assert join.main([str(run_dir.path), "--sbatch"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("#!/bin/bash\n# hpcrl: one more inference server for the running run in ")
    assert printed.endswith(f"-m hpcrl.inference.join {run_dir.path} --rank auto\n")
    assert not (run_dir.path / "joins").exists(), "--sbatch claims no rank"


# -- a real joined server


def test_join_a_real_server_registers_past_the_runs_ranks_serves_and_ends_with_its_lease(tiny_model, tmp_path):
    cfg = make_cfg(tmp_path, tiny_model)
    run_dir = make_run(cfg)
    token = create_token(run_dir.path)
    live_controller_file(run_dir)  # this test process plays the controller: alive, on this node
    registry = Registry(run_dir.registry)
    out = (tmp_path / "join.out").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.inference.join", str(run_dir.path)], stdout=out, stderr=out)
    try:
        entry = _wait_registered(registry, proc, run_dir, timeout_s=90)
        assert (entry.rank, entry.pid, entry.node) == (2, proc.pid, socket.gethostname())  # exec kept the pid
        lease_port = int(entry.extra["lease"].rsplit(":", 1)[1])
        assert 21100 <= entry.port < 21200 and 21100 <= lease_port < 21200  # server rank 2 % 2 = 0's slot (1)
        assert f"as server 2 (pid {proc.pid})" in (tmp_path / "join.out").read_text()
        with urllib.request.urlopen(f"http://{entry.address}/health", timeout=10) as r:
            assert r.status == 200
        assert _renew(entry.extra["lease"], token, "another") is False  # held by this controller's lease alone
        lost = []
        with LeaseKeeper(registry, ["server"], "c0ffee", token, 3.0, lambda e, why: lost.append(e.rank)) as keeper:
            time.sleep(2)  # the controller's keeper renews every registered server: the joined one too
            key = ("server", 2, proc.pid, entry.extra["lease"])
            assert proc.poll() is None and key in keeper.answered and keeper.errors == {} and lost == []
        stopped = time.monotonic()
        assert proc.wait(timeout=30) == 143  # no renewal for lease_s (3 s): it SIGTERMs itself
        assert time.monotonic() - stopped >= 2
        assert registry.entries("server") == []
        assert not psutil.pid_exists(entry.extra["server_pid"]) or _zombie(entry.extra["server_pid"])
        assert "no word from controller c0ffee" in run_dir.log_file("server", 2).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_registered(registry: Registry, proc: subprocess.Popen, run_dir: RunDir, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries = registry.entries("server")
        if entries:
            return entries[0]
        if proc.poll() is not None:
            log = run_dir.log_file("server", 2)
            pytest.fail(f"join exited with {proc.returncode}: {log.read_text() if log.exists() else ''}")
        time.sleep(0.1)
    pytest.fail(f"the joined server did not register in {timeout_s} s")


def _renew(address: str, token: str, controller: str) -> bool:
    request = urllib.request.Request(
        f"http://{address}/lease",
        data=json.dumps({"controller": controller}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())["ok"]


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
