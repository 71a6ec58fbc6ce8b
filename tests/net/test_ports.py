"""Port probing and per-rank allocation, checked with real sockets and real racing processes."""

import json
import logging
import os
import re
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.net import PortAllocator, default_port_range, ephemeral_range, has_ipv6, is_port_free
from hpcrl.net.address import MAX_PORT

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 32
# Generous: 32 interpreters starting on a 2-core machine under load can take tens of seconds.
DEADLINE_S = 180

# Each child: say ready, wait for the start file so all allocate at once, bind what it got, report,
# and keep the ports bound until the done file appears so no later rank could reuse them.
CHILD = """
import json, os, socket, sys, time
from hpcrl.net import PortAllocator
rank, world, low, high, start, done = sys.argv[1:]
rank, world, low, high = int(rank), int(world), int(low), int(high)
deadline = time.monotonic() + float(os.environ["RACE_DEADLINE_S"])
def wait_for(path):
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: {path} never appeared")
        time.sleep(0.002)
print("ready", flush=True)
wait_for(start)
ports = PortAllocator((low, high), rank=rank, world_size=world).allocate(2)
servers, errors = [], []
for port in ports:
    try:
        servers.append(socket.create_server(("", port)))
    except OSError as error:
        errors.append(f"{port}: {error}")
print(json.dumps({"rank": rank, "ports": ports, "errors": errors}), flush=True)
wait_for(done)
"""


def test_default_range_is_below_ephemeral_range():
    low, high = default_port_range()
    assert 1024 <= low < high <= ephemeral_range()[0]


def test_ephemeral_range_is_ordered():
    low, high = ephemeral_range()
    assert 1 <= low <= high <= MAX_PORT


def test_port_held_on_ipv4_only_is_not_free():
    with socket.create_server(("0.0.0.0", 0)) as server:
        port = server.getsockname()[1]
        assert not is_port_free(port)
    assert is_port_free(port)


def test_port_held_on_ipv4_loopback_is_not_free_on_that_host_or_the_wildcard():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert not is_port_free(port)
        assert not is_port_free(port, host="127.0.0.1")
    assert is_port_free(port, host="127.0.0.1")


def test_port_held_on_ipv6_only_is_not_free():
    if not has_ipv6():
        pytest.skip("this machine has no IPv6: binding ::1 failed")
    for bind_host in ("::", "::1"):
        # create_server sets IPV6_V6ONLY, so the IPv4 side of the port stays free.
        with socket.create_server((bind_host, 0), family=socket.AF_INET6) as server:
            port = server.getsockname()[1]
            assert not is_port_free(port)
            assert not is_port_free(port, host="::1")
        assert is_port_free(port)


def test_is_port_free_rejects_bad_input():
    with pytest.raises(ValueError, match="got 0"):
        is_port_free(0)
    with pytest.raises(ValueError, match="'node1'"):
        is_port_free(20000, host="node1")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"port_range": (80, 20000)}, "(80, 20000)"),
        ({"port_range": (20000, 20000)}, "(20000, 20000)"),
        ({"port_range": (20000, 70000)}, "(20000, 70000)"),
        ({"rank": 4, "world_size": 4}, "rank must be in 0..3"),
        ({"rank": -1}, "got -1"),
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
        ({"port_range": (20000, 20010), "world_size": 32, "rank": 0}, "fewer than world_size=32"),
        ({"start_offset": -5}, "start_offset must be >= 0, got -5"),
    ],
)
def test_allocator_rejects_bad_config(kwargs, words):
    kwargs = {"port_range": (20000, 21000), **kwargs}
    with pytest.raises(ValueError, match=re.escape(words)):
        PortAllocator(**kwargs)


def test_allocator_slices_are_equal_and_disjoint():
    slices = [PortAllocator((20000, 20105), rank=r, world_size=10).slice for r in range(10)]
    assert slices == [(20000 + 10 * rank, 20010 + 10 * rank) for rank in range(10)]


def test_allocator_never_hands_out_a_port_twice_and_then_is_exhausted():
    low = _free_window(3)
    allocator = PortAllocator((low, low + 3), start_offset=1)
    assert allocator.allocate() == [low + 1]
    assert sorted(allocator.allocate(2)) == [low, low + 2]
    with pytest.raises(RuntimeError, match=rf"rank 0 of 1 .*\[{low}, {low + 3}\)"):
        allocator.allocate()
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        allocator.allocate(0)


def test_allocator_skips_ports_in_use(caplog):
    # A port the kernel picked is in the ephemeral range, so this also shows the overlap warning.
    with socket.create_server(("0.0.0.0", 0)) as server:
        port = server.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="hpcrl.net.ports"):
            allocator = PortAllocator((port, port + 1))
        assert "overlaps the ephemeral range" in caplog.text
        with pytest.raises(RuntimeError, match=f"found 0 of 1 requested free ports in its slice \\[{port}"):
            allocator.allocate()


def test_racing_processes_get_distinct_ports_in_their_own_slices(tmp_path):
    low = _free_window(WORLD_SIZE * 8)
    high = low + WORLD_SIZE * 8
    start, done = tmp_path / "start", tmp_path / "done"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RACE_DEADLINE_S": str(DEADLINE_S)}
    children = []
    try:
        for rank in range(WORLD_SIZE):
            argv = [sys.executable, "-c", CHILD, *map(str, (rank, WORLD_SIZE, low, high, start, done))]
            children.append(subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=REPO_ROOT, env=env))
        deadline = time.monotonic() + DEADLINE_S
        assert set(_read_one_line_each(children, deadline)) == {"ready"}
        start.touch()
        reports = [json.loads(line) for line in _read_one_line_each(children, deadline)]
        done.touch()
        for child in children:
            assert child.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert [r["errors"] for r in reports] == [[]] * WORLD_SIZE, "every child binds what it was given"
    ports = [port for r in reports for port in r["ports"]]
    assert len(set(ports)) == len(ports) == 2 * WORLD_SIZE
    for r in reports:
        slice_low = low + r["rank"] * 8
        assert all(slice_low <= port < slice_low + 8 for port in r["ports"]), r


def _read_one_line_each(children: list[subprocess.Popen], deadline: float) -> list[str]:
    """The first line each child writes, in child order; fails if any is late or exits first."""
    fds = [_stdout_fd(child) for child in children]
    buffers = dict.fromkeys(fds, b"")
    pending = set(fds)
    with selectors.DefaultSelector() as selector:
        for fd in pending:
            selector.register(fd, selectors.EVENT_READ)
        while pending:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{len(pending)} of {len(children)} children did not report in time"
            for key, _ in selector.select(timeout=remaining):
                chunk = os.read(key.fd, 4096)
                assert chunk, f"a child exited before reporting; buffered: {buffers[key.fd]!r}"
                buffers[key.fd] += chunk
                if b"\n" in buffers[key.fd]:
                    pending.discard(key.fd)
                    selector.unregister(key.fd)
    # A child writes nothing after this line until the parent answers, so splitting loses nothing.
    return [buffers[fd].split(b"\n", 1)[0].decode() for fd in fds]


def _stdout_fd(child: subprocess.Popen) -> int:
    assert child.stdout is not None, "children are started with stdout=PIPE"
    return child.stdout.fileno()


def _free_window(size: int) -> int:
    """The start of `size` consecutive ports in the default range that are all free right now."""
    low, high = default_port_range()
    for start in range(low, high - size, size):
        if all(is_port_free(port) for port in range(start, start + size)):
            return start
    pytest.fail(f"no {size} consecutive free ports in {low}..{high}; is something holding them?")
