"""``SlurmFleet`` without a Slurm: one job per worker (names, ranks, resources), what a requeued, ended, lost, dropped
or replaced rank does to ``check_alive`` and the bookkeeping, readiness timed from each job's start, and a hang
report's job for each rank. Job states come from a fake watcher; sbatch, squeue and scancel are fake commands."""

import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcrl.config.schema import ClusterConfig, RoleResources
from hpcrl.controller.hang import slurm_jobs
from hpcrl.launch.base import RoleSpec, WorkerFailed, WorkerRequeued
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slots import PortSlots
from hpcrl.launch.slurm import SlurmScheduler
from hpcrl.launch.slurm import fleet as fleet_module
from hpcrl.launch.slurm.fleet import SlurmFleet
from hpcrl.launch.slurm.task import WorkerTask
from hpcrl.launch.slurm.watch import UNKNOWN, JobRef, JobState
from hpcrl.launch.stacks import job_of
from hpcrl.rundir import RunDir

RUNNING, PENDING = JobState("RUNNING"), JobState("PENDING", reason="BeginTime")
SERVER = RoleSpec("server", ["python", "-m", "hpcrl.inference.worker"], workers=2, job_per_worker=True)


class FakeWatcher:
    """Job states set by the test; ``forget`` moves a job to the state ``after_forget`` holds for it, if any."""

    def __init__(self):
        self.states: dict[str, JobState] = {}
        self.after_forget: dict[str, JobState] = {}

    def watch(self, job: JobRef) -> None:
        self.states.setdefault(job.name, JobState("PENDING", reason="Priority"))

    def state(self, job: JobRef) -> JobState:
        return self.states.get(job.name, UNKNOWN)

    def forget(self, job: JobRef) -> None:
        if job.name in self.after_forget:
            self.states[job.name] = self.after_forget.pop(job.name)


class Fleet:
    """A fleet of ``workers`` server ranks with fake job submission, cancellation and states."""

    def __init__(self, tmp_path: Path, monkeypatch, workers: int = 2, timeout_s: float = 60.0, queue_s=None):
        self.run_dir = RunDir.create(tmp_path, "exp", "trial")
        self.registry = Registry(self.run_dir.registry)
        self.watcher = FakeWatcher()
        self.submitted: list[tuple[int, str]] = []  # (rank, job id)
        self.cancelled: list[str] = []
        monkeypatch.setattr(fleet_module, "cancel", lambda ids: self.cancelled.extend(ids))
        monkeypatch.setattr(fleet_module, "wait_gone", lambda ids, timeout_s: [])
        monkeypatch.setattr(fleet_module, "POLL_S", 0.02)
        spec = RoleSpec("server", ["w"], workers=workers, job_per_worker=True, setup_timeout_s=timeout_s)
        folder = self.run_dir.path / "slurm"
        self.fleet = SlurmFleet(spec, self.registry, self.submit, self.watcher, folder, self.run_dir, 5.0, queue_s)
        self.fleet.start()

    def submit(self, rank: int) -> JobRef:
        job = JobRef(str(100 + len(self.submitted)))
        self.submitted.append((rank, job.job_id))
        self.watcher.watch(job)
        return job

    def set(self, rank: int, state: JobState) -> None:
        self.watcher.states[self.fleet.rank_jobs[rank].name] = state

    def register(self, rank: int, pid: int = 1000) -> None:
        self.registry.register(Entry("server", rank, "10.0.0.1", 5000 + rank, pid=pid + rank, node=f"n{rank + 1}"))

    def running(self) -> None:
        """Every rank's job runs and its worker has registered; check_alive has seen them run."""
        for rank in self.fleet.ranks:
            self.set(rank, RUNNING)
            self.register(rank)
        self.fleet.check_alive()

    def registered(self) -> list[int]:
        return [e.rank for e in self.registry.entries("server")]


def test_a_requeued_rank_is_reported_once_per_requeue_and_its_stale_entry_goes(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch)
    assert f.submitted == [(0, "100"), (1, "101")]
    f.running()
    f.fleet.mark_lost(0, "did not renew its lease")
    f.set(0, PENDING)  # scontrol requeue: RUNNING, COMPLETING, then PENDING (BeginTime) under the same job id
    with pytest.raises(WorkerRequeued) as err:
        f.fleet.check_alive()
    assert (err.value.role, err.value.worker) == ("server", 0)
    assert str(err.value).startswith(
        "server worker 0 went back to the queue: its Slurm job 100 (node n1) is PENDING (reason: BeginTime); "
        "it registers anew once it runs again"
    ), err.value
    assert f.registered() == [1] and f.fleet.lost == {}, "the stale entry and the lost mark are gone"
    f.fleet.check_alive()  # once: still queued, nothing more to report
    assert f.fleet.queued()
    f.set(0, RUNNING)
    f.fleet.check_alive()
    f.register(0, pid=2000)
    f.set(0, JobState("COMPLETING"))
    f.fleet.check_alive()
    f.set(0, PENDING)  # requeued again: reported again
    with pytest.raises(WorkerRequeued):
        f.fleet.check_alive()
    assert f.submitted == [(0, "100"), (1, "101")] and f.cancelled == [], "a requeued job comes back by itself"


def test_a_running_rank_whose_worker_left_the_registry_counts_as_lost_after_a_grace(tmp_path, monkeypatch):
    # a node cut off: its worker ends itself once its lease runs out (and unregisters, on a filesystem the cut left
    # alone), while Slurm calls the job RUNNING until it calls the node down
    f = Fleet(tmp_path, monkeypatch)
    f.running()
    f.registry.unregister("server", 1)
    f.fleet.check_alive()  # within the grace: a requeue would show in squeue by now
    monkeypatch.setattr(fleet_module, "UNREGISTERED_GRACE_S", 0.0)
    with pytest.raises(WorkerFailed) as err:
        f.fleet.check_alive()
    assert err.value.worker == 1 and "on node n2 left the registry" in str(err.value), err.value
    assert "its Slurm job 101 (node n2) is RUNNING" in str(err.value)
    f.fleet.restart(1)  # a lost rank may be replaced though its job still runs
    assert f.submitted[-1] == (1, "102") and f.cancelled == ["101"]


def test_a_job_requeued_between_two_looks_is_known_by_its_registry_entry(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch)
    f.fleet.check_alive()  # both pending: nothing ran, nothing to report
    f.register(1)  # it ran and registered while no one looked, and is back in the queue
    with pytest.raises(WorkerRequeued) as err:
        f.fleet.check_alive()
    assert err.value.worker == 1 and f.registered() == []


def test_a_worker_that_registered_within_a_cached_queued_state_is_not_taken_for_requeued(tmp_path, monkeypatch):
    # the state is up to cache_s old: a replacement whose worker registered right after its job started still reads
    # PENDING; a fresh look says RUNNING, and its entry must stay (before, it was removed and never seen ready)
    f = Fleet(tmp_path, monkeypatch)
    f.register(1)
    f.watcher.after_forget[f.fleet.rank_jobs[1].name] = RUNNING
    f.fleet.check_alive()
    assert f.registered() == [1]


def test_a_preempted_job_is_read_once_more_before_it_counts_as_ended(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch)
    f.running()
    # sacct's answer between the requeued job's two records, then squeue's: it is back in the queue
    f.set(0, JobState("PREEMPTED", "0:0"))
    f.watcher.after_forget["100"] = PENDING
    with pytest.raises(WorkerRequeued):
        f.fleet.check_alive()
    f.set(1, JobState("PREEMPTED", "0:0"))  # still PREEMPTED when read again: it ended
    with pytest.raises(WorkerFailed) as err:
        f.fleet.check_alive()
    assert type(err.value) is WorkerFailed and err.value.worker == 1
    assert "its Slurm job 101 (node n2) is PREEMPTED (exit code 0:0)" in str(err.value)


def test_an_ended_job_fails_its_rank_with_its_log_and_job_output(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch)
    f.running()
    f.run_dir.log_file("server", 1).write_text("serving\nKilled by the OOM killer\n")
    (f.run_dir.path / "slurm").mkdir()
    (f.run_dir.path / "slurm" / "101_0_log.err").write_text("submitit INFO starting\nsrun: error: n2: task 0\n")
    f.set(1, JobState("CANCELLED", "0:15"))
    with pytest.raises(WorkerFailed) as err:
        f.fleet.check_alive()
    e = err.value
    assert (e.role, e.worker, e.log_file) == ("server", 1, f.run_dir.log_file("server", 1))
    assert e.state == "ended: its Slurm job 101 (node n2) is CANCELLED (exit code 0:15)"
    assert e.log_tail.splitlines()[:4] == [
        "serving",
        "Killed by the OOM killer",
        "--- 101_0_log.err:",
        "srun: error: n2: task 0",
    ]
    f.set(1, RUNNING)
    f.fleet.mark_lost(1, "did not renew its lease within 30 s")
    with pytest.raises(WorkerFailed, match=r"^server worker 1 did not renew its lease within 30 s \(its Slurm job 101"):
        f.fleet.check_alive()


def test_drop_cancels_the_rank_s_job_and_stops_checking_it(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch, workers=3)
    f.running()
    f.set(1, JobState("FAILED", "1:0"))
    f.fleet.drop(1)
    assert f.cancelled == ["101"] and f.registered() == [0, 2]
    f.fleet.check_alive()  # rank 1's FAILED job is no longer checked
    assert f.fleet.rank_jobs == {0: JobRef("100"), 2: JobRef("102")}
    f.fleet.stop()
    assert f.cancelled == ["101", "100", "101", "102"], "stop cancels every job the fleet submitted"


def test_restart_replaces_an_ended_or_dropped_rank_with_a_new_job_and_refuses_a_running_one(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch)
    f.running()
    with pytest.raises(ValueError, match="server worker 1: its Slurm job 101 is RUNNING; only an ended, lost or"):
        f.fleet.restart(1)
    f.set(1, JobState("NODE_FAIL"))
    f.fleet.restart(1)
    assert f.cancelled == ["101"] and f.submitted[-1] == (1, "102") and f.registered() == [0]
    assert f.fleet.rank_jobs == {0: JobRef("100"), 1: JobRef("102")}
    f.fleet.check_alive()  # the new job is pending: nothing to report
    f.fleet.mark_lost(0, "is silent")
    f.fleet.restart(0)  # lost, though RUNNING
    assert f.submitted[-1] == (0, "103") and f.fleet.lost == {}
    f.fleet.drop(1)
    f.fleet.restart(1)  # a replacement for one dropped earlier
    assert f.submitted[-1] == (1, "104") and sorted(f.fleet.rank_jobs) == [0, 1]
    f.fleet.stop()
    f.fleet.stop()  # idempotent
    assert sorted(f.cancelled[-5:]) == ["100", "101", "102", "103", "104"] and len(f.cancelled) == 8


def test_wait_ready_times_each_rank_from_its_job_s_start_and_fails_at_once_when_a_job_ends(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch, timeout_s=0.5)
    f.set(0, RUNNING)
    f.register(0)

    def start_late() -> None:  # rank 1 waits in the queue past the setup timeout, then starts and registers
        time.sleep(1.0)
        f.set(1, RUNNING)
        time.sleep(0.2)
        f.register(1)

    late = threading.Thread(target=start_late)
    late.start()
    begin = time.monotonic()
    entries = f.fleet.wait_ready()
    late.join()
    assert [e.rank for e in entries] == [0, 1] and time.monotonic() - begin > 1.0

    g = Fleet(tmp_path / "g", monkeypatch, timeout_s=0.3)
    g.set(0, RUNNING)
    g.set(1, RUNNING)
    g.register(0)
    with pytest.raises(TimeoutError, match=r"server ranks \[1\] did not register .* within 0.3 s of their Slurm jobs"):
        g.fleet.wait_ready()
    h = Fleet(tmp_path / "h", monkeypatch, timeout_s=60)
    h.set(1, JobState("FAILED", "7:0"))
    begin = time.monotonic()
    with pytest.raises(WorkerFailed, match="server worker 1 ended: its Slurm job 101 is FAILED"):
        h.fleet.wait_ready()
    assert time.monotonic() - begin < 5


def test_a_rank_waiting_past_the_queue_timeout_fails(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch, queue_s=0.2)
    f.set(0, RUNNING)
    assert f.fleet.queued()
    time.sleep(0.3)
    with pytest.raises(
        TimeoutError, match=r"server worker 1: Slurm job 101 is still PENDING .* after 0 s in the queue"
    ):
        f.fleet.queued()


def test_a_hang_report_reads_each_rank_of_a_fleet_inside_its_own_job(tmp_path, monkeypatch):
    f = Fleet(tmp_path, monkeypatch)
    jobs = slurm_jobs([f.fleet])
    assert jobs == {("server", 0): JobRef("100"), ("server", 1): JobRef("101")}
    assert job_of(jobs, Entry("server", 1, "h", 1, node="n2")) == JobRef("101")
    assert job_of({"trainer": JobRef("7", 1)}, Entry("trainer", 3, "h", 1)) == JobRef("7", 1)
    assert job_of(jobs, Entry("server", 2, "h", 1)) is None


FAKE_SLURM = """#!/bin/bash
echo "$(basename "$0") $*" >> "$FAKE_SLURM_LOG"
if [[ $(basename "$0") == sbatch ]]; then
  n=$(( $(cat "$FAKE_SLURM_LOG.n" 2>/dev/null || echo 700) + 1 )); echo $n > "$FAKE_SLURM_LOG.n"
  echo "Submitted batch job $n"
fi
"""


def fake_slurm(tmp_path: Path, monkeypatch) -> Path:
    """sbatch (prints the next job id, from 701), squeue (lists nothing) and scancel that log their calls."""
    (tmp_path / "bin").mkdir()
    for name in ("sbatch", "squeue", "scancel"):
        (tmp_path / "bin" / name).write_text(FAKE_SLURM)
        (tmp_path / "bin" / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(tmp_path / "calls"))
    return tmp_path / "calls"


def test_the_scheduler_submits_one_single_worker_job_per_rank(tmp_path, monkeypatch):
    calls = fake_slurm(tmp_path, monkeypatch)
    run_dir = RunDir.create(tmp_path / "runs", "exp", "trial")
    cluster = ClusterConfig(kind="slurm", submit_mode="per_role", partition="spot", roles={})
    spec = RoleSpec(
        "server", ["w"], workers=4, nodes=2, gpus_per_worker=2, cpus_per_worker=3, job_per_worker=True,
        resources=RoleResources(qos="low", extra_sbatch=["--requeue"]),
    )  # fmt: skip
    scheduler = SlurmScheduler(run_dir, PortSlots({"server": 4}), cluster, job_prefix="p-")
    Registry(run_dir.registry).register(Entry("server", 3, "h", 1))  # an earlier attempt's
    fleet = scheduler.start(spec)
    assert isinstance(fleet, SlurmFleet) and scheduler.job_ids == ["701", "702", "703", "704"]
    assert (
        fleet.rank_jobs == {k: JobRef(str(701 + k)) for k in range(4)}
        and Registry(run_dir.registry).entries("server") == []
    )
    for rank in range(4):
        script = (run_dir.path / "slurm" / f"{701 + rank}_submission.sh").read_text()
        for option in (f"--job-name=p-server-{rank}", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=3",
                       "--gpus-per-node=2", "--partition=spot", "--qos=low", "--requeue"):  # fmt: skip
            assert f"#SBATCH {option}\n" in script, (option, script)
        task = pickle.loads((run_dir.path / "slurm" / f"{701 + rank}_submitted.pkl").read_bytes()).function
        assert (task.rank, task.env["HPCRL_WORLD_SIZE"], task.workers) == (rank, "4", 4)
    fleet.stop()
    assert "scancel 701 702 703 704\n" in calls.read_text()
    with pytest.raises(ValueError, match="one job per worker: replace the worker, with the fleet's restart"):
        scheduler.restart(fleet)


@pytest.mark.parametrize("mode", ["hetjob", "steps"])
def test_one_job_per_worker_is_refused_outside_per_role_mode(tmp_path, mode):
    scheduler = SlurmScheduler(
        RunDir.create(tmp_path, "e", "t"), PortSlots({"server": 2}), ClusterConfig(kind="slurm", submit_mode=mode)
    )
    with pytest.raises(
        ValueError,
        match=f"server: one Slurm job per worker \\(job_per_worker\\) needs cluster.submit_mode=per_role, got {mode}",
    ):
        scheduler.start_all([SERVER])
    with pytest.raises(ValueError, match="job_per_worker needs a plain role"):
        RoleSpec("trainer", ["w"], workers=2, torchrun=True, job_per_worker=True)


# what a Slurm task runs (submitit's _submit loads the pickle and calls it), with the environment of task 0
BECOME_WORKER = """import os, pickle, sys
from hpcrl.launch.slurm.task import exec_worker
exec_worker(pickle.loads(sys.stdin.buffer.read()), {"SLURM_PROCID": "0", "PATH": os.environ["PATH"]})
"""


def test_a_task_with_a_fixed_rank_runs_that_rank_whatever_its_slurm_task(tmp_path):
    argv = ["sh", "-c", 'echo "rank $HPCRL_RANK"']
    task = WorkerTask("server", argv, {}, tmp_path / "logs", workers=4, nodes=1, rank=3)
    subprocess.run([sys.executable, "-c", BECOME_WORKER], input=pickle.dumps(task), check=True, timeout=60)
    assert (tmp_path / "logs" / "server-3.log").read_text().splitlines()[-1] == "rank 3"
    assert not (tmp_path / "logs" / "server-0.log").exists()
