import json
import logging
import multiprocessing
import os
import stat
import time

import pytest

from hpcrl.launch.registry import Entry, Registry
from hpcrl.logs import setup_logging
from hpcrl.rundir import RunDir, write_atomic


def test_run_dir_layout(tmp_path):
    run = RunDir.create(tmp_path, "exp", "trial")
    assert run.path == tmp_path / "exp" / "trial"
    assert run.logs.is_dir() and run.registry.is_dir() and run.checkpoints.is_dir()
    assert run.log_file("trainer", 1) == run.path / "logs" / "trainer-1.log"
    assert run.write_config("a: 1\n").read_text() == "a: 1\n"


def test_the_config_a_run_uses_is_its_newest_and_a_new_start_drops_an_earlier_runs_resumed_ones(tmp_path):
    run = RunDir.create(tmp_path, "exp", "trial")
    assert run.write_first_config("a: 1\n") == run.config_file == run.path / "config.yaml"
    first = run.add_resumed_config("a: 2\n")
    for n in (3, 4, 5, 6, 7, 8, 9, 10):  # numbers, not names, order them: 10 after 9
        run.add_resumed_config(f"a: {n}\n")
    assert first.name == "config.resumed-1.yaml" and run.config_file.name == "config.resumed-9.yaml"
    assert run.config_file.read_text() == "a: 10\n" and run.write_config("a: 11\n") == run.config_file
    assert (run.path / "config.yaml").read_text() == "a: 1\n"
    run.write_first_config("b: 1\n")
    assert sorted(p.name for p in run.path.glob("config*")) == ["config.yaml"]
    assert run.config_file.read_text() == "b: 1\n"


def test_a_run_is_resumable_with_a_complete_checkpoint_only(tmp_path):
    run = RunDir.create(tmp_path, "exp", "trial")
    for name in ("step_000004.partial", "step_000002.broken", "step_000006"):
        (run.checkpoints / name).mkdir()
    for name in ("step_000004.partial", "step_000002.broken"):
        (run.checkpoints / name / "controller.json").write_text("{}")
    assert not run.resumable(), "a step directory without controller.json is an interrupted save"
    (run.checkpoints / "step_000006" / "controller.json").write_text("{}")
    assert run.resumable()


def test_write_atomic_leaves_no_temporary_file_and_sets_mode(tmp_path):
    target = tmp_path / "secret"
    write_atomic(target, "x", mode=0o600)
    assert target.read_text() == "x" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]


def test_registry_entries_carry_bracketed_ipv6_addresses(tmp_path):
    registry = Registry(tmp_path)
    registry.register(Entry("server", 1, "fd00::2", 30001))
    registry.register(Entry("server", 0, "10.0.0.1", 30000, extra={"weight_version": 3}))
    entries = registry.entries("server")
    assert [e.address for e in entries] == ["10.0.0.1:30000", "[fd00::2]:30001"]
    assert entries[0].pid == os.getpid() and entries[0].extra == {"weight_version": 3}
    assert json.loads((tmp_path / "server-0.json").read_text())["port"] == 30000
    registry.clear("server")
    assert registry.entries("server") == []


def _register_later(directory, delay):
    time.sleep(delay)
    Registry(directory).register(Entry("trainer", 1, "127.0.0.1", 20001))


def test_wait_returns_once_every_rank_registered(tmp_path):
    registry = Registry(tmp_path)
    registry.register(Entry("trainer", 0, "127.0.0.1", 20000))
    child = multiprocessing.get_context("spawn").Process(target=_register_later, args=(tmp_path, 0.5))
    child.start()
    try:
        entries = registry.wait("trainer", 2, timeout_s=60)
    finally:
        child.join(30)
    assert [e.rank for e in entries] == [0, 1]


def test_wait_names_missing_ranks_at_the_deadline(tmp_path):
    registry = Registry(tmp_path)
    registry.register(Entry("server", 0, "127.0.0.1", 20000))
    with pytest.raises(TimeoutError, match=r"server ranks \[1, 2\] did not register .*within 0.3 s.*setup_timeout_s"):
        registry.wait("server", 3, timeout_s=0.3, poll_s=0.05)


def test_wait_fails_at_once_when_a_worker_died(tmp_path):
    def dead():
        raise RuntimeError("server 0 (pid 123) exited with code 1")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 1"):
        Registry(tmp_path).wait("server", 1, timeout_s=600, check_alive=dead)
    assert time.monotonic() - start < 60


def test_log_lines_carry_role_and_rank(tmp_path, capsys):
    log_file = tmp_path / "logs" / "trainer-3.log"
    setup_logging("trainer", 3, "INFO", log_file)
    logging.getLogger("hpcrl.test").info("hello")
    for handler in logging.getLogger().handlers:
        handler.flush()
    assert "[trainer:3] INFO hpcrl.test: hello" in log_file.read_text()
    assert "[trainer:3]" in capsys.readouterr().err
    logging.basicConfig(force=True)
