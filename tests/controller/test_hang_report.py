"""A stalled trainer call ends the run with a hang report naming who did not answer, with every process's stacks.

Unit tests of the naming (``hpcrl/controller/hang.py``) and of the stack requests (``hpcrl/launch/stacks.py``) with
real processes, one of them stopped; then one job on this machine whose trainer rank 1 is SIGSTOPped mid-run.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpcrl.controller.hang import HangError, Unanswered, lost_worker, stalled_call, summarize, write_hang_report
from hpcrl.launch import stacks
from hpcrl.launch.base import WorkerFailed
from hpcrl.launch.registry import Entry
from hpcrl.launch.slurm.watch import JobRef
from hpcrl.launch.stacks import REQUEST_FILE, Stacks, request_stacks, srun_argv
from hpcrl.rpc.errors import RemoteError, RpcTimeoutError
from tests.conftest import REPO
from tests.controller.test_job import processes_of, wait_for_steps

HANG_S = 15  # cluster.hang_timeout_s of the job below


def entry(role: str, rank: int, pid: int = 100, port: int = 5000) -> Entry:
    return Entry(role, rank, "10.0.0.1", port + rank, pid=pid + rank, node=f"node{rank}")


def timeout(e: Entry, started: float = 0.0) -> RpcTimeoutError:
    return RpcTimeoutError(e.rank, e.address, "train_step", started, 15.0)


def test_hang_report_takes_only_calls_that_timed_out():
    t0, t1 = timeout(entry("trainer", 0), started=86400.0), timeout(entry("trainer", 1))
    t0.others = [t1, RemoteError(2, "h:1", "train_step", "ValueError", "bad", "")]
    what = "train_step within 15 s (cluster.hang_timeout_s; called at 1970-01-02 00:00:00 UTC)"
    assert stalled_call(t0) == Unanswered(what, frozenset({"10.0.0.1:5000", "10.0.0.1:5001"}))
    assert stalled_call(RemoteError(0, "h:1", "train_step", "ValueError", "bad", "")) is None
    assert stalled_call(TimeoutError("elsewhere")) is None


def test_hang_report_takes_a_worker_failure_only_when_its_lease_was_lost():
    entries = [entry("trainer", 0), entry("trainer", 1)]
    lost = {"trainer": {1: "on node node1 (10.0.0.1:5001) has not answered the controller for 30 s"}}
    silent = WorkerFailed("trainer", 1, lost["trainer"][1], "")
    heartbeat = "the controller's heartbeat (cluster.worker_lease_s)"
    assert lost_worker(silent, lost, entries) == Unanswered(heartbeat, frozenset({"10.0.0.1:5001"}))
    on_slurm = WorkerFailed("trainer", "job 7", f"RUNNING, but its worker 1 {lost['trainer'][1]}", "")
    assert lost_worker(on_slurm, lost, entries) == Unanswered(heartbeat, frozenset({"10.0.0.1:5001"}))
    assert lost_worker(WorkerFailed("trainer", 0, -9, ""), lost, entries) is None, "it died: no hang"
    assert lost_worker(WorkerFailed("server", 1, "FAILED", ""), lost, entries) is None


CALL = Unanswered(
    "train_step within 15 s (cluster.hang_timeout_s; called at ...)", frozenset({"10.0.0.1:5000", "10.0.0.1:5001"})
)


def test_hang_report_names_first_the_rank_that_answered_nothing(tmp_path):
    trainers, server = [entry("trainer", 0), entry("trainer", 1)], entry("server", 0, pid=50, port=6000)
    stacks = [
        Stacks(trainers[0], True, tmp_path / "stacks" / "trainer-0.txt", "written by the process itself"),
        Stacks(trainers[1], False, None, "none: not on this host"),
        Stacks(server, True, tmp_path / "stacks" / "server-0.txt", "written by the process itself"),
    ]
    headline, text = summarize(CALL, stacks, tmp_path)
    assert headline == (
        "trainer rank 1 on node node1 (pid 101) did not answer train_step within 15 s (cluster.hang_timeout_s; "
        "called at ...), nor a request for its stacks"
    )
    lines = text.splitlines()
    assert lines[0] == f"hang report: {headline}"
    silent, waiting, other = (lines.index(s) for s in [line for line in lines if line.endswith(":")])
    assert silent < waiting < other
    assert "trainer rank 1  node node1  pid 101  address 10.0.0.1:5001: no stacks (none: not on this host)" in text
    assert lines[waiting + 1].startswith("  trainer rank 0  node node0  pid 100  address 10.0.0.1:5000: stacks/")
    assert lines[other + 1].startswith("  server rank 0  node node0  pid 50  address 10.0.0.1:6000: stacks/server-0")


def test_hang_report_says_every_rank_is_alive_when_each_answered(tmp_path):
    trainers = [entry("trainer", 0), entry("trainer", 1)]
    stacks = [Stacks(t, True, tmp_path / f"trainer-{t.rank}.txt", "written by the process itself") for t in trainers]
    headline, _ = summarize(CALL, stacks, tmp_path)
    assert headline.startswith("trainer rank 0 on node node0 (pid 100); trainer rank 1 on node node1 (pid 101) did ")
    assert headline.endswith("; each answered a request for its stacks")


WATCHER = """
import sys, time
from hpcrl.launch.stacks import watch_stack_requests
watch_stack_requests(sys.argv[1], sys.argv[2], 0, poll_s=0.2)
def waiting_in_a_collective():
    time.sleep(120)
print("watching", flush=True)
waiting_in_a_collective()
"""


def watcher(run_dir: Path, role: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WATCHER, str(run_dir), role], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "watching\n"
    return proc


def test_hang_report_gets_live_stacks_from_the_process_and_a_stopped_ones_by_py_spy(tmp_path):
    (tmp_path / REQUEST_FILE).write_text(json.dumps({"id": "an earlier run's", "dir": str(tmp_path / "old")}))
    live, stopped = watcher(tmp_path, "trainer"), watcher(tmp_path, "server")
    here = socket.gethostname()
    entries = [
        Entry("trainer", 0, "h", 1, pid=live.pid, node=here),
        Entry("server", 0, "h", 2, pid=stopped.pid, node=here),
    ]
    far = Entry("rollout", 0, "h", 3, pid=1, node="elsewhere")
    try:
        time.sleep(0.5)
        assert not (tmp_path / "old").exists(), "a request left by an earlier run is not answered"
        os.kill(stopped.pid, signal.SIGSTOP)
        start = time.monotonic()
        got = request_stacks(tmp_path, tmp_path / "stacks", [*entries, far], timeout_s=3)
        took = time.monotonic() - start
        os.kill(stopped.pid, signal.SIGCONT)  # resumed after the report, as Slurm's SIGCONT before its SIGTERM does
        time.sleep(1)  # five of its polls
    finally:
        for proc in (live, stopped):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert [(s.entry.role, s.answered) for s in got] == [("trainer", True), ("server", False), ("rollout", False)]
    own = got[0].path.read_text()
    assert own.startswith(f"pid {live.pid} on {here}") and 'File "<string>", line 6 in waiting_in_a_collective' in own
    spied = got[1].path.read_text()
    assert got[1].note.startswith("read by py-spy") and "waiting_in_a_collective" in spied
    assert spied.startswith(f"Process {stopped.pid}: "), "py-spy's stacks, not replaced by a late answer"
    assert not (tmp_path / REQUEST_FILE).exists(), "the request is withdrawn once the report has its stacks"
    assert got[2].path is None and got[2].note.startswith("none: not on this host")
    assert took < 3 + 10 + 2, "every wait has its deadline: the request's, then py-spy's"


def test_py_spy_runs_on_a_far_node_inside_its_job_and_its_het_component():
    dump = ["/venv/bin/py-spy", "dump", "--nonblocking", "--pid", "42"]
    where = ["--overlap", "--nodelist=n2", "--nodes=1", "--ntasks=1", "--quiet"]
    assert srun_argv(JobRef("7", 1), "n2", dump) == ["srun", "--jobid=7", "--het-group=1", *where, *dump]
    assert srun_argv(JobRef("8"), "n2", dump) == ["srun", "--jobid=8", *where, *dump]


# srun here: job 7 runs the command on "its node" (this host), job 8 is gone, job 9's step never starts
FAKE_SRUN = """#!/bin/bash
echo "$$ $*" >> "$SRUN_LOG"
case "$1" in
  --jobid=7) while [[ $1 == --* ]]; do shift; done; exec "$@" ;;
  --jobid=8) echo "srun: error: Unable to confirm allocation for job 8: Invalid job id specified"; exit 1 ;;
  *) exec sleep 60 ;;
esac
"""


def test_hang_report_reads_a_silent_process_on_another_node_through_srun_within_a_deadline(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(FAKE_SRUN)
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("SRUN_LOG", str(tmp_path / "srun.log"))
    monkeypatch.setattr(stacks, "SRUN_PY_SPY_TIMEOUT_S", 2.0)
    stopped = watcher(tmp_path / "elsewhere", "trainer")  # answers another run directory's requests: silent here
    far = [Entry(role, 0, "h", port, pid=stopped.pid, node="n2") for port, role in enumerate(["trainer", "critic"])]
    far.append(Entry("rollout", 0, "h", 3, pid=stopped.pid, node="n3"))
    jobs = {"trainer": JobRef("7", 1), "critic": JobRef("8"), "rollout": JobRef("9", 3)}
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        start = time.monotonic()
        got = request_stacks(tmp_path, tmp_path / "stacks", far, timeout_s=0.5, jobs=jobs)
        took = time.monotonic() - start
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
        stopped.kill()
        stopped.wait()
    assert [s.answered for s in got] == [False, False, False]
    assert got[0].note.startswith("read by py-spy (dump --nonblocking) on its node, through srun")
    assert got[0].path == tmp_path / "stacks" / "trainer-0.txt" and "waiting_in_a_collective" in got[0].path.read_text()
    assert (got[1].path, got[1].note) == (
        None, "none: py-spy through srun failed (srun: error: Unable to confirm allocation for job 8: Invalid job "
        "id specified)"
    )  # fmt: skip
    assert (got[2].path, got[2].note) == (None, "none: py-spy through srun read nothing within 2 s")
    calls = [line.split(" ", 1) for line in (tmp_path / "srun.log").read_text().splitlines()]
    assert sorted(args.split(" --overlap")[0] for _, args in calls) == ["--jobid=7 --het-group=1", "--jobid=8",
                                                                        "--jobid=9 --het-group=3"]  # fmt: skip
    late = next(int(pid) for pid, args in calls if args.startswith("--jobid=9"))
    assert not psutil.pid_exists(late), "the late srun is ended by its PID"
    assert took < 0.5 + 2 + stacks.SRUN_STOP_S + 2, "each wait has its deadline"


def test_hang_report_moves_an_earlier_report_aside(tmp_path):
    (tmp_path / "hang_report").mkdir()
    (tmp_path / "hang_report" / "summary.txt").write_text("the first hang")
    headline, summary = write_hang_report(tmp_path, [], CALL, stacks_wait_s=0.1)
    assert summary == tmp_path / "hang_report" / "summary.txt" and summary.read_text().startswith("hang report: ")
    assert (tmp_path / "hang_report.1" / "summary.txt").read_text() == "the first hang"
    error = HangError(headline, summary)
    assert str(error) == f"{headline}; the hang report, with every process's stacks: {summary}"


@pytest.mark.slow
def test_hang_report_of_a_sigstopped_trainer_rank_names_it_and_ends_the_run(tmp_path):
    run_dir = tmp_path / "default" / "hang"
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", "run.trial=hang", "run.max_steps=1000"]
    cmd += ["eval.stop_at_accuracy=0", "eval.every_steps=0", "allocation.trainer.workers=2", "rollout.workers=1"]
    # a lease longer than the hang timeout: the stopped rank's lease endpoint would otherwise name it first
    cmd += [f"cluster.hang_timeout_s={HANG_S}", "cluster.worker_lease_s=120"]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        wait_for_steps(job, run_dir, 1)
        rank1 = json.loads((run_dir / "registry" / "trainer-1.json").read_text())
        victim = psutil.Process(rank1["pid"])
        victim.suspend()  # SIGSTOP
        stopped = time.monotonic()
        _, stderr = job.communicate(timeout=HANG_S + 60)
        took = time.monotonic() - stopped
        time.sleep(1)
        left = processes_of(str(run_dir))
    finally:
        if job.poll() is None:
            job.kill()
        for p in processes_of(str(run_dir)):
            p.resume()
            p.kill()
    assert job.returncode == 1, stderr[-3000:]
    assert not left, f"no process of the run may be left: {[p.pid for p in left]}"
    summary = run_dir / "hang_report" / "summary.txt"
    named = f"trainer rank 1 on node {rank1['node']} (pid {rank1['pid']}) did not answer"
    assert f"{named} " in stderr and str(summary) in stderr, stderr[-3000:]
    text = summary.read_text()
    assert text.startswith(f"hang report: {named} ") and f"within {HANG_S} s" in text
    stacks = run_dir / "hang_report" / "stacks"
    for alive in ("trainer-0", "server-0", "rollout-0"):
        assert 'File "' in (stacks / f"{alive}.txt").read_text(), alive
    assert "hpcrl" in (stacks / "trainer-1.txt").read_text(), "the stopped rank's stacks, read by py-spy"
    print(f"the run ended {took:.1f} s after rank 1 stopped (hang timeout {HANG_S} s)")
