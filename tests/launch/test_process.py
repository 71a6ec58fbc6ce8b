"""spawn / Child / ChildGroup with real processes: logs, environment, exit reports, and tree cleanup."""

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from hpcrl.launch.process import ChildExited, ChildGroup, _signals_held, spawn, stop_all
from tests.conftest import REPO

GRACE_S = 0.5  # short grace periods keep the SIGKILL paths quick

# One process of a test tree. argv[1] is a comma list of per-level flags, this process first:
# "T" ignores SIGTERM, "X" exits right after starting its child, "S" starts its child in a new
# session (out of reach of a session scan), "-" none of these. With more levels it starts the next
# one. Each prints "ready <pid>" once its signal handling is set up.
NODE = """
import os, signal, subprocess, sys, time
mine, *rest = sys.argv[1].split(",")
signal.signal(signal.SIGTERM, signal.SIG_IGN if "T" in mine else signal.SIG_DFL)
if rest:
    subprocess.Popen([sys.executable, __file__, ",".join(rest)], start_new_session="S" in mine)
print("ready", os.getpid(), flush=True)
if "X" not in mine:
    time.sleep(60)
"""

# A parent that owns two trees in a ChildGroup, prints their PIDs, and waits to be signalled.
PARENT = """
import json, signal, sys, time
from pathlib import Path
from hpcrl.launch.process import ChildGroup

signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the test runner ignores SIGINT
out, node = Path(sys.argv[1]), sys.argv[2]
with ChildGroup(grace_s=0.5) as group:
    for i, spec in enumerate(["-,-", "T,T"]):
        group.spawn(f"c{i}", [sys.executable, node, spec], out / f"c{i}.log")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text = "".join((out / f"c{i}.log").read_text() for i in range(2))
        if text.count("ready ") == 4:
            break
        time.sleep(0.02)
    print(json.dumps([int(line.split()[1]) for line in text.splitlines() if line.startswith("ready ")]), flush=True)
    time.sleep(60)
"""


@pytest.fixture
def node(tmp_path):
    """``node("T,-")``: the argv of a NODE tree (here: a SIGTERM-ignoring leader with one child)."""
    script = tmp_path / "node.py"
    script.write_text(NODE)
    return lambda spec: [sys.executable, str(script), spec]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def wait_for(predicate, timeout_s: float = 15.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def ready_pids(log_file: Path, count: int) -> list[int]:
    def read():
        text = log_file.read_text() if log_file.exists() else ""
        pids = [int(line.split()[1]) for line in text.splitlines() if line.startswith("ready ")]
        return pids if len(pids) >= count else None

    return wait_for(read, what=f"{count} ready lines in {log_file}")


def gone(pid: int) -> bool:
    """Exited (a zombie counts: only its parent or init can reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_log_file_gets_stdout_and_stderr_and_is_appended(tmp_path):
    log_file = tmp_path / "deep" / "dir" / "child.log"
    for word in ("first", "second"):
        child = spawn("printer", py(f"import sys; print('out-{word}'); print('err-{word}', file=sys.stderr)"), log_file)
        wait_for(lambda c=child: c.poll() is not None, what="the printer to exit")
        assert child.poll() == 0
    text = log_file.read_text()
    for line in ("out-first", "err-first", "out-second", "err-second"):
        assert line in text
    assert text.index("err-first") < text.index("out-second")


def test_env_values_arrive_verbatim_without_a_shell(tmp_path):
    value = """a b "double" 'single' $HOME `id` ; echo x | cat \\ end"""
    code = "import json, os; print(json.dumps([os.environ['TRICKY'], os.environ.get('PATH')]))"
    child = spawn("env", py(code), tmp_path / "env.log", env={"TRICKY": value})
    wait_for(lambda: child.poll() is not None, what="the env child to exit")
    tricky, path = json.loads(child.log_tail(1))
    assert tricky == value
    assert path == os.environ.get("PATH")  # the parent's environment is inherited
    assert "TRICKY" not in os.environ


def test_check_alive_raises_with_exit_code_and_log_tail(tmp_path):
    child = spawn("crasher", py("for i in range(50): print(f'line {i}')\nraise SystemExit(3)"), tmp_path / "c.log")
    wait_for(lambda: child.poll() is not None, what="the crasher to exit")
    assert not child.alive()
    with pytest.raises(ChildExited) as info:
        child.check_alive()
    err = info.value
    assert (err.name, err.pid, err.exit_code) == ("crasher", child.pid, 3)
    message = str(err)
    assert "crasher" in message and str(child.pid) in message and "exit code 3" in message
    assert "line 49" in message and "line 19" not in message  # the last 30 lines only
    assert str(child.log_file) in message


def test_check_alive_passes_while_running_and_names_the_killing_signal(tmp_path):
    child = spawn("sleeper", py("import time; time.sleep(60)"), tmp_path / "s.log")
    child.check_alive()
    assert child.alive()
    child.stop(grace_s=GRACE_S)
    with pytest.raises(ChildExited, match="SIGTERM"):
        child.check_alive()


@pytest.mark.parametrize("spec", ["-,-,-", "T,-,-", "-,T,T", "-,-,T", "S,T,-"])
def test_stop_ends_the_whole_tree(tmp_path, node, spec):
    log_file = tmp_path / "tree.log"
    child = spawn("tree", node(spec), log_file)
    pids = ready_pids(log_file, 3)
    assert child.pid in pids
    child.stop(grace_s=GRACE_S)
    assert all(gone(pid) for pid in pids), {pid: gone(pid) for pid in pids}
    assert child.poll() == (-signal.SIGKILL if spec.startswith("T") else -signal.SIGTERM)


def test_stop_reaches_descendants_orphaned_when_the_leader_died(tmp_path, node):
    log_file = tmp_path / "orphans.log"
    child = spawn("orphaner", node("X,-,T"), log_file)
    pids = ready_pids(log_file, 3)
    wait_for(lambda: gone(child.pid), what="the leader to exit")
    orphans = [pid for pid in pids if pid != child.pid]
    assert not any(gone(pid) for pid in orphans)
    child.stop(grace_s=GRACE_S)
    assert all(gone(pid) for pid in orphans)
    assert child.poll() == 0


def test_stop_is_idempotent_and_handles_an_unreaped_child(tmp_path):
    child = spawn("quick", py("pass"), tmp_path / "q.log")
    wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, what="an unreaped exited child")
    child.stop(grace_s=GRACE_S)
    child.stop(grace_s=GRACE_S)
    assert child.poll() == 0
    assert gone(child.pid)

    with spawn("sleeper", py("import time; time.sleep(60)"), tmp_path / "s.log") as sleeper:
        sleeper.stop(grace_s=GRACE_S)
    sleeper.stop(grace_s=GRACE_S)
    assert sleeper.poll() == -signal.SIGTERM


def test_stop_all_shares_one_grace_period(tmp_path, node):
    children = [spawn(f"stubborn{i}", node("T"), tmp_path / f"{i}.log") for i in range(3)]
    for i in range(3):
        ready_pids(tmp_path / f"{i}.log", 1)
    grace_s = 1.0
    start = time.monotonic()
    stop_all(children, grace_s=grace_s)
    elapsed = time.monotonic() - start
    assert all(c.poll() == -signal.SIGKILL for c in children)
    # stopping one child after another would take at least 3 * grace_s
    assert elapsed < 2.5 * grace_s, elapsed


def test_child_group_stops_everything_on_an_exception(tmp_path, node):
    handler_before = signal.getsignal(signal.SIGTERM)
    pids = []
    with pytest.raises(RuntimeError, match="boom"), ChildGroup(grace_s=GRACE_S) as group:
        for i in range(2):
            group.spawn(f"w{i}", node("-,T,-"), tmp_path / f"w{i}.log")
            pids += ready_pids(tmp_path / f"w{i}.log", 3)
        assert signal.getsignal(signal.SIGTERM) is not handler_before
        group.check_alive()
        raise RuntimeError("boom")
    assert len(pids) == 6 and all(gone(pid) for pid in pids)
    assert signal.getsignal(signal.SIGTERM) is handler_before


def test_a_signal_during_a_held_step_is_raised_when_the_step_is_done(tmp_path):
    steps = []
    with pytest.raises(SystemExit) as info, ChildGroup(grace_s=GRACE_S) as group:
        with _signals_held():  # as during ChildGroup.spawn and stop_all
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs in here and holds its exception back
            child = group.spawn("late", py("import time; time.sleep(60)"), tmp_path / "late.log")
            steps.append("registered")
        steps.append("after")
    assert info.value.code == 128 + signal.SIGTERM
    assert steps == ["registered"]
    assert child.poll() == -signal.SIGTERM


def test_child_group_outside_the_main_thread_leaves_signals_alone(tmp_path):
    errors = []

    def run():
        try:
            with ChildGroup(grace_s=GRACE_S) as group:
                group.spawn("t", py("import time; time.sleep(60)"), tmp_path / "t.log")
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=20)
    assert not errors


def test_spawn_of_a_missing_program_names_the_child(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        spawn("ghost", ["/nonexistent/program", "--flag"], tmp_path / "g.log")
    assert any("ghost" in note for note in info.value.__notes__)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_parent_stopped_by_a_signal_leaves_no_child_alive(tmp_path, node, signum):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), node("-")[1]],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 20)
        assert ready, "the parent script printed no PIDs within 20 s"
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 4 and not any(gone(pid) for pid in pids)
        parent.send_signal(signum)
        code = parent.wait(timeout=20)
    finally:
        parent.kill()
        parent.wait()
    stderr = parent.stderr.read()
    # SIGTERM becomes SystemExit(143); an uncaught KeyboardInterrupt makes Python die by SIGINT
    assert code == (128 + signal.SIGTERM if signum == signal.SIGTERM else -signal.SIGINT), stderr
    assert all(gone(pid) for pid in pids), stderr


# A parent that promises to end within 2 s of a signal (end_within), owns a tree, and then will not stop:
# it swallows the SystemExit the signal raises and goes on, as a busy or stuck controller would.
STUBBORN = """
import json, signal, sys, time
from pathlib import Path
from hpcrl.launch import process
from hpcrl.launch.process import ChildGroup

signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the test runner ignores SIGINT (xdist's workers)
process.end_within(float(sys.argv[3]))
out, node = Path(sys.argv[1]), sys.argv[2]
with ChildGroup(grace_s=0.5) as group:
    group.spawn("c", [sys.executable, node, "T,T"], out / "c.log")  # ignores SIGTERM, as a hung worker might
    while not (out / "c.log").exists() or (out / "c.log").read_text().count("ready ") < 2:
        time.sleep(0.02)
    lines = (out / "c.log").read_text().splitlines()
    pids = [int(line.split()[1]) for line in lines if line.startswith("ready ")]
    while True:
        try:  # the PIDs are printed inside the try: the test's first signal can only come in here
            if pids:
                print(json.dumps(pids), flush=True)
                pids = []
            time.sleep(60)
        except BaseException:
            pass  # the signal's SystemExit, swallowed
"""


@pytest.mark.parametrize("second", [False, True], ids=["deadline", "second_signal"])
def test_a_signalled_process_ends_within_its_deadline_even_when_it_will_not_stop(tmp_path, node, second):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    deadline_s = 3.0 if not second else 60.0
    argv = [sys.executable, str(script), str(tmp_path), node("-")[1], str(deadline_s)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 20)
        assert ready, "the parent script printed no PIDs within 20 s"
        pids = json.loads(parent.stdout.readline())
        signalled = time.monotonic()
        parent.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert parent.poll() is None, "the first signal alone does not end it (it swallows it)"
        if second:
            signalled = time.monotonic()
            parent.send_signal(signal.SIGINT)
        code = parent.wait(timeout=20)
        took = time.monotonic() - signalled
    finally:
        parent.kill()
        parent.wait()
    stderr = parent.stderr.read()
    assert code == (128 + (signal.SIGINT if second else signal.SIGTERM)), stderr
    assert (took < 5) if second else (deadline_s <= took < deadline_s + 5), took  # "at once": not the deadline
    assert ("a second signal" if second else "still running 3 s after SIGTERM") in stderr, stderr
    assert wait_for(lambda: all(gone(pid) for pid in pids), 5, "the tree to be gone"), "every descendant killed"


def test_a_spawned_child_and_its_children_ignore_slurms_warning_signal(tmp_path):
    # Slurm's USR2@N reaches every process of a step; only the controller acts on it. The child runs the
    # program itself (one PID: the wrapper's shell execs it), and a child of its own inherits the ignored signal
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    code += "time.sleep(60)"
    with spawn("w", py(code), tmp_path / "w.log") as child:
        (grandchild,) = wait_for(lambda: psutil.Process(child.pid).children(), what="a grandchild")
        assert psutil.Process(child.pid).cmdline()[:2] == [sys.executable, "-c"]
        for pid in (child.pid, grandchild.pid):
            os.kill(pid, signal.SIGUSR2)
        time.sleep(0.5)
        assert child.poll() is None and grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE


def test_spawn_finds_a_program_on_the_childs_path_or_says_it_is_not_there(tmp_path):
    tool = tmp_path / "bin" / "hpcrl-test-tool"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\necho tool ran with "$1"\n')
    tool.chmod(0o755)
    with spawn("t", ["hpcrl-test-tool", "a b"], tmp_path / "t.log", env={"PATH": str(tool.parent)}) as child:
        assert wait_for(lambda: child.poll() is not None, what="the tool to end") and child.poll() == 0
    assert "tool ran with a b" in (tmp_path / "t.log").read_text()
    with pytest.raises(FileNotFoundError, match="hpcrl-test-tool"):
        spawn("t", ["hpcrl-test-tool"], tmp_path / "t.log", env={"PATH": str(tmp_path)})
    tool.chmod(0o644)
    with pytest.raises(PermissionError):
        spawn("t", [str(tool)], tmp_path / "t.log")
