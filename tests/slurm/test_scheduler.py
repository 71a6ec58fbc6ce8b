"""SlurmScheduler on the real test Slurm: roles as one job each and as one heterogeneous job, readiness
through the registry, failures read from squeue/sacct, and every job cancelled by id on every way out."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcrl.config.schema import ClusterConfig, RoleResources
from hpcrl.launch.base import RoleSpec, WorkerFailed, WorkerRequeued
from hpcrl.launch.registry import Entry
from hpcrl.launch.slots import PortSlots
from hpcrl.launch.slurm import SlurmScheduler
from hpcrl.launch.slurm.task import expand_hostlist
from hpcrl.net import is_port_free
from hpcrl.rundir import RunDir
from tests.slurm.conftest import release_when_requeued, sacct, sbatch, wait_for_state

pytestmark = pytest.mark.slurm

WORKER = [sys.executable, str(Path(__file__).resolve().parents[1] / "launch" / "scripts" / "rank_worker.py")]
CONTROLLER = Path(__file__).resolve().parent / "scripts" / "slurm_controller.py"
MODES = ["per_role", "hetjob"]
FAIL_WITHIN_S = 30  # a dead worker or a cancelled job must be reported within this


@pytest.fixture
def run_dir(tmp_path):
    # spaces and quotes: every path the scheduler writes into a batch script or srun line must be quoted
    return RunDir.create(tmp_path / "runs with 'quotes' and \"spaces\"", "exp", "trial")


def cluster(partition: str, mode: str) -> ClusterConfig:
    return ClusterConfig(
        kind="slurm",
        partition=partition,
        time_min=5,
        submit_mode=mode,
        roles={},  # RoleResources defaults for every role
    )


def scheduler(run_dir, slots, slurm_cluster, job_prefix, mode) -> SlurmScheduler:
    return SlurmScheduler(
        run_dir, slots, cluster(slurm_cluster.partition, mode), job_prefix=job_prefix, cache_s=1.0, stop_timeout_s=30
    )


def plain(workers: int = 2, **env: str) -> RoleSpec:
    return RoleSpec("plain", WORKER, workers=workers, env=env, setup_timeout_s=60)


def ranks(workers: int = 2, **env: str) -> RoleSpec:
    # a thread per rank: two ranks and torchrun share this 2-core machine
    return RoleSpec(
        "ranks", WORKER, workers=workers, torchrun=True, env={"OMP_NUM_THREADS": "1", **env}, setup_timeout_s=60
    )


def assert_listening(entries: list[Entry], slots: PortSlots, role: str) -> None:
    assert [e.rank for e in entries] == list(range(len(entries)))
    assert len({e.port for e in entries}) == len(entries), entries
    for e in entries:
        low, high = slots.allocator(slots.slot(role, e.rank)).slice
        assert low <= e.port < high, f"rank {e.rank} took port {e.port}, outside its slot's slice"
        socket.create_connection((e.host, e.port), timeout=5).close()


def queued(job_ids) -> list[str]:
    """The jobs (and hetjob components) squeue still lists, of those with these ids."""
    out = subprocess.run(
        ["squeue", "-h", "-a", "-j", ",".join(job_ids), "-o", "%i"], capture_output=True, text=True, timeout=30
    )
    # ids slurmctld has already forgotten make squeue fail: none of those is queued
    assert out.returncode == 0 or "Invalid job id" in out.stderr, out.stderr
    return out.stdout.split()


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result or not result[0]:
        proc.kill()  # its jobs are left to no_leftover_jobs, which cancels them by id
        raise AssertionError(f"the controller printed nothing in {timeout_s} s; stderr:\n{proc.stderr.read()}")
    return result[0]


def raises_soon(check, timeout_s: float = FAIL_WITHIN_S) -> Exception:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            check()
        except Exception as e:
            return e
        time.sleep(0.2)
    raise AssertionError(f"{check} raised nothing in {timeout_s} s")


def sacct_rows(job_id: str, done, timeout_s: float = 15) -> dict[str, dict[str, str]]:
    """sacct's rows of JOB_ID once ``done(rows)`` holds: slurmdbd hears of a job's name and state a moment after
    slurmctld (meanwhile sacct may show a half-written row, named "allocation")."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = {key: row for key, row in sacct(job_id).items() if "." not in key}  # no steps
        if (rows and done(rows)) or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def named(*names: str):
    return lambda rows: sorted(row["JobName"] for row in rows.values()) == sorted(names)


def cancelled(rows) -> bool:
    return all(row["State"].startswith("CANCELLED") for row in rows.values())


@pytest.mark.parametrize("mode", MODES)
def test_a_plain_role_and_a_torchrun_role_register_and_their_jobs_end_with_the_scheduler(
    slurm_cluster, job_prefix, run_dir, mode
):
    slots = PortSlots({"plain": 2, "ranks": 2}, rendezvous=("ranks",))
    with scheduler(run_dir, slots, slurm_cluster, job_prefix, mode) as s:
        workers, trainers = s.start_all([plain(), ranks()])
        plain_entries, rank_entries = workers.wait_ready(), trainers.wait_ready()
        assert_listening(plain_entries, slots, "plain")
        assert_listening(rank_entries, slots, "ranks")
        assert [e.extra["HPCRL_WORLD_SIZE"] for e in plain_entries] == ["2", "2"]
        assert [(e.extra["RANK"], e.extra["WORLD_SIZE"]) for e in rank_entries] == [("0", "2"), ("1", "2")]
        assert {e.extra["CUDA_VISIBLE_DEVICES"] for e in plain_entries + rank_entries} == {""}  # asked for none
        assert "rank 1 listening" in run_dir.log_file("ranks", 1).read_text()
        assert "rank 1 listening" in run_dir.log_file("plain", 1).read_text()
        workers.check_alive()
        trainers.check_alive()

        if mode == "hetjob":
            job_id = s.job_ids[0]
            assert s.job_ids == [job_id] and (workers.job_id, trainers.job_id) == (f"{job_id}+0", f"{job_id}+1")
            rows = sacct_rows(job_id, named(f"{job_prefix}plain", f"{job_prefix}ranks"))
            assert rows[f"{job_id}+0"]["JobName"] == f"{job_prefix}plain", rows
            assert rows[f"{job_id}+1"]["JobName"] == f"{job_prefix}ranks", rows
            # components never share a node
            assert rows[f"{job_id}+0"]["NodeList"] != rows[f"{job_id}+1"]["NodeList"], rows
        else:
            assert len(s.job_ids) == 2 and [workers.job_id, trainers.job_id] == s.job_ids
            for job_id, role in zip(s.job_ids, ["plain", "ranks"], strict=True):
                assert sacct_rows(job_id, named(f"{job_prefix}{role}"))[job_id]["JobName"] == f"{job_prefix}{role}"
        job_ids = list(s.job_ids)
        assert len(queued(job_ids)) == 2
    assert queued(job_ids) == []
    for job_id in job_ids:  # scancelled by id
        rows = sacct_rows(job_id, cancelled)
        assert cancelled(rows) and len(rows) == (2 if mode == "hetjob" else 1), rows


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_that_exits_at_start_fails_wait_ready_naming_the_job(slurm_cluster, job_prefix, run_dir, mode):
    slots = PortSlots({"ranks": 1, "plain": 2}, rendezvous=("ranks",))
    bad = plain(RANK_WORKER_EXIT="7", RANK_WORKER_EXIT_RANK="1")
    with scheduler(run_dir, slots, slurm_cluster, job_prefix, mode) as s:
        # in a hetjob the failing role is component 1, beside a healthy one
        groups = s.start_all([ranks(1), bad]) if mode == "hetjob" else [s.start(bad)]
        group = groups[-1]
        start = time.monotonic()
        with pytest.raises(WorkerFailed) as err:
            group.wait_ready()
        assert time.monotonic() - start < FAIL_WITHIN_S
        job_ids = list(s.job_ids)
    message = str(err.value)
    assert err.value.role == "plain" and err.value.worker == f"job {group.job_id}"
    assert err.value.state == "FAILED", message
    assert message.startswith(f"plain worker job {group.job_id} FAILED"), message
    assert "rank 1: told to exit with 7" in message, message  # the failing worker's own log
    assert err.value.log_file == run_dir.log_file("plain", 1)
    assert queued(job_ids) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_job_cancelled_mid_run_fails_check_alive(slurm_cluster, job_prefix, run_dir, mode):
    slots = PortSlots({"plain": 1, "ranks": 1}, rendezvous=("ranks",))
    with scheduler(run_dir, slots, slurm_cluster, job_prefix, mode) as s:
        groups = s.start_all([plain(1), ranks(1)])
        for group in groups:
            group.wait_ready()
        victim = groups[-1]
        subprocess.run(["scancel", victim.job_id], check=True, timeout=30)
        err = raises_soon(victim.check_alive)
        job_ids = list(s.job_ids)
    assert isinstance(err, WorkerFailed), err
    assert err.worker == f"job {victim.job_id}" and err.state == "CANCELLED", err
    assert f"ranks worker job {victim.job_id} CANCELLED" in str(err)
    assert queued(job_ids) == []


@pytest.mark.parametrize("mode", MODES)
def test_stop_cancels_the_group_s_job_by_id(slurm_cluster, job_prefix, run_dir, mode):
    slots = PortSlots({"plain": 1, "ranks": 1}, rendezvous=("ranks",))
    with scheduler(run_dir, slots, slurm_cluster, job_prefix, mode) as s:
        first, second = s.start_all([plain(1), ranks(1, RANK_WORKER_NEVER_READY="1")])
        first.wait_ready()
        with pytest.raises(TimeoutError, match=r"ranks ranks \[0\] did not register") as err:
            second.wait_ready(timeout_s=2)
        assert re.search(rf"Slurm job {re.escape(second.job_id)} is (RUNNING|PENDING)", str(err.value.__notes__))
        second.stop()  # returns once squeue no longer lists the job
        if mode == "per_role":
            assert queued([second.job_id]) == [] and queued([first.job_id]) == [first.job_id]
            first.check_alive()  # a job of its own: untouched
        else:  # one heterogeneous job: its roles share one fate
            assert queued(s.job_ids) == []
        err = raises_soon(second.check_alive)
        assert isinstance(err, WorkerFailed) and err.state == "CANCELLED", err
        second.stop()  # idempotent


def test_a_torchrun_role_spans_two_nodes(slurm_cluster, job_prefix, run_dir):
    slots = PortSlots({"ranks": 2}, rendezvous=("ranks",))
    with scheduler(run_dir, slots, slurm_cluster, job_prefix, "per_role") as s:
        group = s.start(RoleSpec("ranks", WORKER, workers=2, nodes=2, torchrun=True, setup_timeout_s=60))
        entries = group.wait_ready()  # one torchrun per node met at the rendezvous on the first node
        assert_listening(entries, slots, "ranks")
        assert [(e.extra["RANK"], e.extra["WORLD_SIZE"]) for e in entries] == [("0", "2"), ("1", "2")]
        job_id = s.job_ids[0]
        rows = sacct_rows(job_id, named(f"{job_prefix}ranks"))
        assert len(expand_hostlist(rows[job_id]["NodeList"])) == 2, rows


def test_two_torchrun_roles_of_one_hetjob_meet_each_at_its_own_rendezvous_and_a_dead_rank_names_its_role(
    slurm_cluster, job_prefix, run_dir
):
    """The trainer and the critic (algorithm=ppo) as components of one heterogeneous job, the critic's ranks on two
    nodes: each role's torchruns meet at the rendezvous its own first node published, and a critic rank that dies
    ends the job, whose every group (the trainer's too) then fails naming the critic and its rank's log."""
    roles = ("trainer", "critic")
    slots = PortSlots({"trainer": 1, "critic": 2}, rendezvous=roles)
    env = {"OMP_NUM_THREADS": "1"}
    trainer = RoleSpec("trainer", WORKER, workers=1, torchrun=True, env=env, setup_timeout_s=60)
    critic = RoleSpec("critic", WORKER, workers=2, nodes=2, torchrun=True, env=env, setup_timeout_s=60)
    with scheduler(run_dir, slots, slurm_cluster, job_prefix, "hetjob") as s:
        trainers, critics = s.start_all([trainer, critic])
        trainer_entries, critic_entries = trainers.wait_ready(), critics.wait_ready()
        assert_listening(critic_entries, slots, "critic")
        assert [(e.extra["RANK"], e.extra["WORLD_SIZE"]) for e in critic_entries] == [("0", "2"), ("1", "2")]
        assert [(e.extra["RANK"], e.extra["WORLD_SIZE"]) for e in trainer_entries] == [("0", "1")]
        critic_nodes = {e.node for e in critic_entries}
        assert len(critic_nodes) == 2 and trainer_entries[0].node not in critic_nodes, (trainer_entries, critic_entries)
        job_id = s.job_ids[0]
        assert (trainers.job_id, critics.job_id) == (f"{job_id}+0", f"{job_id}+1")
        rows = sacct_rows(job_id, named(f"{job_prefix}trainer", f"{job_prefix}critic"))
        assert len(expand_hostlist(rows[f"{job_id}+1"]["NodeList"])) == 2, rows
        # each role's store on its own first node, at a port of its own rendezvous slot
        published = {role: json.loads((run_dir.registry / f"{role}.rendezvous.json").read_text()) for role in roles}
        assert published["trainer"]["host"] == trainer_entries[0].node, published
        assert published["critic"]["host"] in critic_nodes, published
        for role, found in published.items():
            low, high = slots.allocator(slots.rendezvous(role)).slice
            assert low <= found["port"] < high, (role, found)

        (victim,) = [e for e in critic_entries if e.rank == 1]
        os.kill(victim.pid, signal.SIGKILL)  # the nodes are network namespaces: their PIDs are this host's
        killed = time.monotonic()
        err = raises_soon(trainers.check_alive)  # the trainer's component ended FAILED with it, yet names the critic
        took = time.monotonic() - killed
    assert isinstance(err, WorkerFailed), err
    assert err.role == "critic" and err.worker == f"job {job_id}+1", err
    assert str(err).startswith(f"critic worker job {job_id}+1 "), err
    assert err.log_file == run_dir.log_file("critic", 1), err.log_file
    assert took < FAIL_WITHIN_S


def test_the_rendezvous_port_is_chosen_on_the_first_node_not_on_the_controller_s(slurm_cluster, job_prefix, run_dir):
    """The slice's first port is free here but taken on every node: a port probed on the controller's host
    would be that one, and torchrun could not host its store there."""
    slots = PortSlots({"ranks": 2}, rendezvous=("ranks",))
    taken = slots.allocator(slots.rendezvous("ranks")).slice[0]
    assert is_port_free(taken), f"port {taken} must be free on this host for the test to mean anything"
    nodes = len(slurm_cluster.nodes)
    hold = f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {taken})); s.listen(); time.sleep(300)"
    blocker = sbatch(
        f'#!/bin/bash\nsrun python3 -c "{hold}"\n',
        name=f"{job_prefix}blocker",
        workdir=run_dir.path,
        args=(f"--nodes={nodes}", "--ntasks-per-node=1", "--cpus-per-task=1"),
    )
    try:
        wait_for_state(blocker, "RUNNING")
        with scheduler(run_dir, slots, slurm_cluster, job_prefix, "per_role") as s:
            group = s.start(RoleSpec("ranks", WORKER, workers=2, nodes=2, torchrun=True, setup_timeout_s=60))
            entries = group.wait_ready()
            assert [(e.extra["RANK"], e.extra["WORLD_SIZE"]) for e in entries] == [("0", "2"), ("1", "2")]
            published = json.loads((run_dir.registry / "ranks.rendezvous.json").read_text())
            assert published["port"] != taken and published["host"] in slurm_cluster.nodes, published
            assert {e.node for e in entries} <= set(slurm_cluster.nodes) and len({e.node for e in entries}) == 2
    finally:
        subprocess.run(["scancel", blocker], check=False, timeout=30)


def test_an_exception_in_the_block_cancels_every_job(slurm_cluster, job_prefix, run_dir):
    slots = PortSlots({"plain": 1, "ranks": 1}, rendezvous=("ranks",))
    s = scheduler(run_dir, slots, slurm_cluster, job_prefix, "per_role")
    with pytest.raises(RuntimeError, match="boom"), s:
        s.start(plain(1))
        s.start(ranks(1, RANK_WORKER_NEVER_READY="1"))  # still starting, or even pending
        raise RuntimeError("boom")
    assert len(s.job_ids) == 2
    assert queued(s.job_ids) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_controller_cancels_its_jobs(slurm_cluster, job_prefix, tmp_path, signum):
    argv = [sys.executable, str(CONTROLLER), str(tmp_path), slurm_cluster.partition, job_prefix]
    controller = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_ids = json.loads(read_line(controller, 60))  # the job ids, once every worker is ready
        assert len(queued(job_ids)) == 2
        controller.send_signal(signum)
        code = controller.wait(timeout=60)
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
    assert code != 0 and (signum != signal.SIGTERM or code == 143), controller.stderr.read()
    assert queued(job_ids) == []


def test_time_in_the_queue_does_not_count_against_the_setup_timeout(slurm_cluster, job_prefix, run_dir, tmp_path):
    # a job that holds every node for a while: the role's job waits in the queue longer than its setup timeout
    nodes = len(slurm_cluster.nodes)
    blocker = sbatch(
        "#!/bin/bash\nsleep 15\n",
        name=f"{job_prefix}blocker",
        workdir=tmp_path,
        args=(f"--nodes={nodes}", "--exclusive"),
    )
    wait_for_state(blocker, "RUNNING")
    setup_timeout_s = 8.0
    with scheduler(run_dir, PortSlots({"plain": 1}), slurm_cluster, job_prefix, "per_role") as s:
        group = s.start(RoleSpec("plain", WORKER, workers=1, setup_timeout_s=setup_timeout_s))
        started = time.monotonic()
        (entry,) = group.wait_ready()
        waited = time.monotonic() - started
    assert entry.rank == 0
    assert waited > setup_timeout_s, f"the job should have queued behind the blocker, ready after {waited:.1f} s"


def test_a_queue_timeout_fails_a_job_that_waits_too_long(slurm_cluster, job_prefix, run_dir, tmp_path):
    nodes = len(slurm_cluster.nodes)
    blocker = sbatch(
        "#!/bin/bash\nsleep 120\n",
        name=f"{job_prefix}blocker",
        workdir=tmp_path,
        args=(f"--nodes={nodes}", "--exclusive"),
    )
    try:
        wait_for_state(blocker, "RUNNING")
        with scheduler(run_dir, PortSlots({"plain": 1}), slurm_cluster, job_prefix, "per_role") as s:
            group = s.start(RoleSpec("plain", WORKER, workers=1, setup_timeout_s=600))
            group.queue_timeout_s = 3.0  # cluster.queue_timeout_min, in seconds for the test
            with pytest.raises(TimeoutError, match=r"still PENDING.* in the queue; raise cluster.queue_timeout_min"):
                group.wait_ready()
    finally:
        subprocess.run(["scancel", blocker], timeout=30, check=False)


def test_elastic_fleet_a_job_per_worker_ends_is_replaced_and_is_requeued_without_the_others(
    slurm_cluster, job_prefix, run_dir
):
    """A fleet of two workers, each a job of its own submitted with --requeue: rank 1's job cancelled fails rank 1
    alone, and a new job replaces it; rank 0's job requeued is reported once, and rank 0 registers again."""
    requeue = RoleResources(extra_sbatch=["--requeue"])
    spec = RoleSpec("plain", WORKER, workers=2, job_per_worker=True, setup_timeout_s=60, resources=requeue)
    slots = PortSlots({"plain": 2})
    with scheduler(run_dir, slots, slurm_cluster, job_prefix, "per_role") as s:
        fleet = s.start(spec)
        first = fleet.wait_ready()
        assert_listening(first, slots, "plain")
        jobs = fleet.rank_jobs
        assert s.job_ids == [jobs[0].job_id, jobs[1].job_id]
        for rank, job in jobs.items():
            name = f"{job_prefix}plain-{rank}"
            assert sacct_rows(job.job_id, named(name))[job.job_id]["JobName"] == name

        subprocess.run(["scancel", jobs[1].job_id], check=True, timeout=30)
        err = raises_soon(fleet.check_alive)
        assert type(err) is WorkerFailed and err.worker == 1, err
        assert err.state.startswith(f"ended: its Slurm job {jobs[1]} (node {first[1].node}) is CANCELLED"), err
        assert queued([jobs[0].job_id]) == [jobs[0].job_id], "rank 0's job runs on"
        fleet.restart(1)
        assert fleet.rank_jobs[1] != jobs[1] and s.job_ids[-1] == fleet.rank_jobs[1].job_id
        replaced = fleet.wait_ready()
        assert replaced[0] == first[0] and replaced[1].pid != first[1].pid

        release_when_requeued(jobs[0].job_id)  # Slurm would hold it 2 minutes
        subprocess.run(["scontrol", "requeue", jobs[0].job_id], check=True, timeout=30)
        err = raises_soon(fleet.check_alive)
        assert type(err) is WorkerRequeued and err.worker == 0, err
        deadline = time.monotonic() + 60
        while not [e for e in fleet.registry.entries("plain") if e.rank == 0]:
            fleet.check_alive()  # once: it waits in the queue, then starts again, and raises nothing more
            assert time.monotonic() < deadline, (
                f"rank 0 did not register again: job {jobs[0]} {fleet.watcher.state(jobs[0])}"
            )
            time.sleep(0.5)
        back = fleet.wait_ready()
        assert fleet.rank_jobs[0] == jobs[0] and back[0].pid != first[0].pid and back[1] == replaced[1]
        assert run_dir.log_file("plain", 0).read_text().count("rank 0 listening") == 2
        job_ids = list(s.job_ids)
        fleet.stop()
        assert queued(job_ids) == []
