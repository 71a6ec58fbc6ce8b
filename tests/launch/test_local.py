"""LocalScheduler with real processes: readiness through the registry, fast failures, and tree cleanup."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from hpcrl.launch.base import RoleSpec, WorkerFailed
from hpcrl.launch.local import LocalScheduler, visible_gpus
from hpcrl.launch.registry import Entry
from hpcrl.launch.slots import PortSlots
from hpcrl.rundir import RunDir

SCRIPTS = Path(__file__).resolve().parent / "scripts"
WORKER = [sys.executable, str(SCRIPTS / "rank_worker.py")]
GRACE_S = 2.0


@pytest.fixture
def run_dir(tmp_path):
    return RunDir.create(tmp_path, "exp", "trial")


def spec(role: str, workers: int, **kw) -> RoleSpec:
    return RoleSpec(role, WORKER, workers=workers, **{"setup_timeout_s": 60.0, **kw})


def processes(pids) -> list[psutil.Process]:
    """psutil handles (which remember the start time, so a reused PID is never mistaken for ours)."""
    return [psutil.Process(pid) for pid in pids]


def tree(group, entries: list[Entry]) -> list[psutil.Process]:
    """Every process of a group: its children, their descendants, the ranks and their grandchildren."""
    procs = {}
    for child in group.children:
        procs[child.pid] = child._process
        procs.update((p.pid, p) for p in child._process.children(recursive=True))
    pids = [e.pid for e in entries] + [e.extra["grandchild"] for e in entries if "grandchild" in e.extra]
    procs.update((p.pid, p) for p in processes(pids))
    assert all(alive(p) for p in procs.values()), "the tree should be alive before the test ends it"
    return list(procs.values())


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(procs: list[psutil.Process], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p.pid for p in procs if alive(p)]
    assert not left, f"processes still alive: {left}"


def raises_soon(check, timeout_s: float = 30.0) -> Exception:
    """The exception ``check()`` raises within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            check()
        except Exception as e:
            return e
        time.sleep(0.1)
    raise AssertionError(f"{check} raised nothing in {timeout_s} s")


def assert_listening(entries: list[Entry], slots: PortSlots, role: str) -> None:
    assert [e.rank for e in entries] == list(range(len(entries)))
    assert len({e.port for e in entries}) == len(entries)
    for e in entries:
        low, high = slots.allocator(slots.slot(role, e.rank)).slice
        assert low <= e.port < high, f"rank {e.rank} took port {e.port}, outside its slot's slice"
        socket.create_connection((e.host, e.port), timeout=5).close()


def test_torchrun_ranks_register_and_a_killed_rank_fails_check_alive(run_dir):
    slots = PortSlots({"ranks": 2})
    with LocalScheduler(run_dir, slots, grace_s=GRACE_S) as scheduler:
        group = scheduler.start(spec("ranks", 2, torchrun=True))
        entries = group.wait_ready()
        assert_listening(entries, slots, "ranks")
        assert [(e.extra["RANK"], e.extra["WORLD_SIZE"], e.extra["HPCRL_WORLD_SIZE"]) for e in entries] == [
            ("0", "2", "2"),
            ("1", "2", "2"),
        ]
        assert (run_dir.logs / "ranks-launcher.log").exists()
        assert "rank 1 listening" in run_dir.log_file("ranks", 1).read_text()
        group.check_alive()
        procs = tree(group, entries)

        os.kill(entries[1].pid, signal.SIGKILL)
        err = raises_soon(group.check_alive)
        assert isinstance(err, WorkerFailed), err
        assert (err.role, err.worker, err.exit_code) == ("ranks", 1, -9)
        assert "SIGKILL" in str(err) and "rank 1 listening" in str(err) and "torchrun exited" in str(err)
    assert_gone(procs)


def test_plain_workers_register_and_the_whole_tree_ends_with_the_context(run_dir):
    slots = PortSlots({"first": 1, "plain": 3})
    with LocalScheduler(run_dir, slots, grace_s=GRACE_S) as scheduler:
        group = scheduler.start(spec("plain", 3, env={"RANK_WORKER_GRANDCHILD": "1"}))
        entries = group.wait_ready()
        assert_listening(entries, slots, "plain")
        assert [e.pid for e in entries] == [c.pid for c in group.children]
        assert {e.extra["HPCRL_WORLD_SIZE"] for e in entries} == {"3"}
        group.check_alive()
        procs = tree(group, entries)
    assert len(procs) == 6  # three workers and their grandchildren
    assert_gone(procs)


@pytest.mark.parametrize("torchrun", [False, True], ids=["plain", "torchrun"])
def test_a_worker_that_exits_at_start_fails_the_wait_at_once(run_dir, torchrun):
    env = {"RANK_WORKER_EXIT": "7", "RANK_WORKER_EXIT_RANK": "1"}
    with LocalScheduler(run_dir, PortSlots({"bad": 2}), grace_s=GRACE_S) as scheduler:
        group = scheduler.start(spec("bad", 2, torchrun=torchrun, env=env, setup_timeout_s=600))
        start = time.monotonic()
        with pytest.raises(WorkerFailed) as err:
            group.wait_ready()
        assert time.monotonic() - start < 60, "a dead worker must fail the wait at once, not at its deadline"
    assert (err.value.role, err.value.worker, err.value.exit_code) == ("bad", 1, 7)
    message = str(err.value)
    assert message.startswith("bad worker 1 exited with exit code 7")
    assert "rank 1: told to exit with 7" in message  # the worker's own log tail
    assert str(run_dir.log_file("bad", 1)) in message


def test_a_worker_that_never_registers_times_out_naming_the_ranks(run_dir):
    with LocalScheduler(run_dir, PortSlots({"slow": 1}), grace_s=GRACE_S) as scheduler:
        group = scheduler.start(spec("slow", 1, env={"RANK_WORKER_NEVER_READY": "1"}))
        with pytest.raises(TimeoutError, match=r"slow ranks \[0\] did not register .* within 1 s"):
            group.wait_ready(timeout_s=1)
        group.check_alive()  # slow, not dead


def test_an_exception_in_the_context_ends_every_tree_and_stale_entries_do_not_count(run_dir):
    # an entry left by an earlier attempt must not make the new group look ready
    scheduler = LocalScheduler(run_dir, PortSlots({"plain": 1, "ranks": 2}), grace_s=GRACE_S)
    scheduler.registry.register(Entry("plain", 0, "127.0.0.1", 1))
    env = {"RANK_WORKER_GRANDCHILD": "1"}
    procs = []
    with pytest.raises(RuntimeError, match="boom"), scheduler:
        plain = scheduler.start(spec("plain", 1, env=env))
        ranks = scheduler.start(spec("ranks", 2, torchrun=True, env=env))
        entries = plain.wait_ready()
        assert entries[0].pid == plain.children[0].pid, "the stale entry counted as ready"
        procs += tree(plain, entries)
        procs += tree(ranks, ranks.wait_ready())
        raise RuntimeError("boom")
    assert len(procs) == 2 + 1 + 2 * 2  # a worker and its grandchild; torchrun, two ranks and theirs
    assert_gone(procs)


def test_ranks_that_outlive_a_killed_torchrun_are_ended_too(run_dir):
    with LocalScheduler(run_dir, PortSlots({"ranks": 2}), grace_s=GRACE_S) as scheduler:
        group = scheduler.start(spec("ranks", 2, torchrun=True))
        entries = group.wait_ready()
        procs = tree(group, entries)
        os.kill(group.children[0].pid, signal.SIGKILL)
        err = raises_soon(group.check_alive)
        assert isinstance(err, WorkerFailed) and err.worker == "torchrun" and err.exit_code == -9, err
        assert all(alive(p) for p in processes(e.pid for e in entries)), "ranks run on in their own sessions"
    assert_gone(procs)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result or not result[0]:
        proc.kill()
        raise AssertionError(f"controller printed nothing in {timeout_s} s; stderr:\n{proc.stderr.read()}")
    return result[0]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_controller_leaves_no_descendant_alive(tmp_path, signum):
    cmd = [sys.executable, str(SCRIPTS / "controller.py"), str(tmp_path)]
    controller = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        entries = [Entry(**e) for e in json.loads(read_line(controller, 90))]
        me = psutil.Process(controller.pid)
        procs = {p.pid: p for p in me.children(recursive=True)}
        pids = [e.pid for e in entries] + [e.extra["grandchild"] for e in entries]
        procs.update((p.pid, p) for p in processes(pids))
        # 2 plain workers, torchrun, 2 ranks, 4 grandchildren
        assert len(procs) == 9 and all(alive(p) for p in procs.values())
        controller.send_signal(signum)
        code = controller.wait(timeout=30)
    finally:
        controller.kill()
        controller.wait()
    assert code != 0, controller.stderr.read()
    if signum == signal.SIGTERM:
        assert code == 143
    assert_gone(list(procs.values()))


def test_gpus_are_split_among_the_workers_that_ask_for_them(run_dir):
    slots = PortSlots({"two": 2, "none": 1, "greedy": 1})
    with LocalScheduler(run_dir, slots, gpus=["0", "1", "2"], grace_s=GRACE_S) as scheduler:
        two = scheduler.start(spec("two", 2, gpus_per_worker=1))
        none = scheduler.start(spec("none", 1))
        with pytest.raises(ValueError, match=r"greedy needs 1 x 2 GPUs, but only 1 .* free \(2\)"):
            scheduler.start(spec("greedy", 1, gpus_per_worker=2))
        assert [e.extra["CUDA_VISIBLE_DEVICES"] for e in two.wait_ready()] == ["0", "1"]
        assert none.wait_ready()[0].extra["CUDA_VISIBLE_DEVICES"] == ""
        two.stop()  # gives its GPUs back
        greedy = scheduler.start(spec("greedy", 1, gpus_per_worker=2))
        assert greedy.wait_ready()[0].extra["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_specs_the_local_scheduler_cannot_run_fail_before_anything_starts(run_dir):
    scheduler = LocalScheduler(run_dir, PortSlots({"server": 2}), gpus=[])
    with pytest.raises(ValueError, match="nodes must be 1"):
        scheduler.start(spec("server", 2, nodes=2))
    with pytest.raises(ValueError, match="spec has 1 workers but the run's PortSlots counts 2"):
        scheduler.start(spec("server", 1))
    with pytest.raises(ValueError, match="no port slots for role 'trainer'"):
        scheduler.start(spec("trainer", 2))
    with pytest.raises(ValueError, match=r"needs 2 x 1 GPUs, but only 0"):
        scheduler.start(spec("server", 2, gpus_per_worker=1))
    assert scheduler._children.children == []
    missing = RoleSpec("server", [str(run_dir.path / "missing")], workers=2, gpus_per_worker=1)
    scheduler = LocalScheduler(run_dir, PortSlots({"server": 2}), gpus=["0", "1"])
    with pytest.raises(FileNotFoundError, match="while starting server 0"):
        scheduler.start(missing)
    assert scheduler._free_gpus == ["0", "1"], "a group that failed to start holds no GPUs"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"role": "server-proc"}, "letters, digits and '_'"),
        ({"argv": []}, "argv must be a non-empty list"),
        ({"workers": 0}, "workers must be >= 1"),
        ({"workers": 3, "nodes": 2}, "split evenly"),
        ({"setup_timeout_s": 0}, "setup_timeout_s must be > 0"),
        ({"env": {"HPCRL_RANK": "3"}}, "must not set HPCRL_RANK"),
    ],
)
def test_role_spec_rejects_bad_fields(kwargs, message):
    fields = {"role": "server", "argv": ["prog"], **kwargs}
    with pytest.raises(ValueError, match=message):
        RoleSpec(**fields)


def test_worker_failed_says_who_how_and_where():
    err = WorkerFailed("trainer", 3, -9, "line 1\nline 2\n", Path("/run/logs/trainer-3.log"))
    assert str(err) == (
        "trainer worker 3 exited with exit code -9 (killed by SIGKILL) (log: /run/logs/trainer-3.log); "
        "last log lines:\nline 1\nline 2"
    )
    assert WorkerFailed("server", 0, "was cancelled", "").exit_code is None
    assert str(WorkerFailed("server", 0, "was cancelled", "")).endswith("was cancelled; last log lines:\n<empty log>")


def test_a_rank_whose_program_cannot_start_says_so_in_its_log(tmp_path):
    template = str(tmp_path / "r-{rank}.log")
    cmd = [sys.executable, "-m", "hpcrl.launch.local", "--rank-log", template, "--", str(tmp_path / "missing")]
    result = subprocess.run(cmd, env={**os.environ, "RANK": "3"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 127 and result.stdout == result.stderr == ""
    assert f"cannot start rank 3: {tmp_path / 'missing'}" in (tmp_path / "r-3.log").read_text()


def test_a_dead_plain_worker_restarts_with_its_rank_and_registers_again(run_dir):
    slots = PortSlots({"plain": 2})
    with LocalScheduler(run_dir, slots, grace_s=GRACE_S) as scheduler:
        group = scheduler.start(spec("plain", 2, env={"RANK_WORKER_GRANDCHILD": "1"}))
        entries = group.wait_ready()
        with pytest.raises(ValueError, match="still running"):
            group.restart(1)
        grandchild = psutil.Process(entries[1].extra["grandchild"])
        os.kill(entries[1].pid, signal.SIGKILL)
        err = raises_soon(group.check_alive)
        assert isinstance(err, WorkerFailed) and err.worker == 1

        group.restart(1)
        assert_gone([grandchild])  # what the dead worker left in its session is ended
        again = group.wait_ready()
        assert again[0] == entries[0], "the live worker is untouched"
        assert again[1].pid == group.children[1].pid != entries[1].pid
        assert_listening(again, slots, "plain")
        group.check_alive()
        assert run_dir.log_file("plain", 1).read_text().count("--- hpcrl: starting plain 1") == 2  # one log, appended
        procs = tree(group, again)
    assert_gone(procs)


def test_a_worker_the_controller_cannot_reach_counts_as_ended_until_it_is_let_go(run_dir):
    """The lease keeper's verdict (mark_lost): check_alive names it; drop or restart ends what is left of it."""
    slots = PortSlots({"plain": 3})
    with LocalScheduler(run_dir, slots, grace_s=GRACE_S) as scheduler:
        group = scheduler.start(spec("plain", 3))
        entries = group.wait_ready()
        group.mark_lost(1, "on node n2 (10.0.0.2:1) has not answered the controller for 31 s")
        err = raises_soon(group.check_alive)
        assert isinstance(err, WorkerFailed) and (err.role, err.worker) == ("plain", 1)
        assert "plain worker 1 on node n2 (10.0.0.2:1) has not answered the controller for 31 s" in str(err)
        first, second = processes([entries[1].pid, entries[2].pid])
        assert alive(first), "lost, not dead: it still runs"
        group.drop(1)  # the run goes on without it
        assert_gone([first])
        assert [e.rank for e in group.registry.entries("plain")] == [0, 2]
        group.check_alive()
        group.mark_lost(2, "has not answered")
        group.restart(2)  # a lost worker may restart although it still ran: it is ended first
        assert_gone([second])
        group.check_alive()  # no longer lost
        deadline = time.monotonic() + 60
        while not [e for e in group.registry.entries("plain") if e.rank == 2]:
            assert time.monotonic() < deadline, "the restarted worker did not register"
            time.sleep(0.1)
        (again,) = [e for e in group.registry.entries("plain") if e.rank == 2]
        assert again.pid == group.children[2].pid != entries[2].pid


def test_torchrun_ranks_cannot_restart(run_dir):
    with LocalScheduler(run_dir, PortSlots({"ranks": 1}), grace_s=GRACE_S) as scheduler:
        group = scheduler.start(spec("ranks", 1, torchrun=True))
        with pytest.raises(ValueError, match="not torchrun ranks"):
            group.restart(0)


@pytest.mark.parametrize("torchrun", [False, True])
def test_wait_exited_sees_workers_that_end_on_their_own_and_leaves_running_ones_to_stop(run_dir, torchrun):
    with LocalScheduler(run_dir, PortSlots({"done": 2, "busy": 1}), grace_s=GRACE_S) as scheduler:
        done = scheduler.start(spec("done", 2, torchrun=torchrun, env={"RANK_WORKER_EXIT": "0"}))
        busy = scheduler.start(spec("busy", 1, env={"RANK_WORKER_NEVER_READY": "1"}))
        assert done.wait_exited(60)
        assert [child.poll() for child in done.children] == [0] * len(done.children)  # ended by themselves
        started = time.monotonic()
        assert not busy.wait_exited(0.3)
        assert 0.3 <= time.monotonic() - started < 5 and busy.children[0].alive()
    assert not busy.children[0].alive()
    if torchrun:  # not signalled: its log ends without the traceback of a SIGTERM
        assert "SignalException" not in (run_dir.logs / "done-launcher.log").read_text()
