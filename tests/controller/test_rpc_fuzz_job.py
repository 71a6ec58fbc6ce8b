"""The RPC endpoints of a running job, fuzzed from outside while it trains: thousands of unauthenticated,
malformed, truncated and oversized requests at every trainer rank and every lease endpoint. Nothing without
the token gets past the same 401, nothing malformed reaches a handler, and the run finishes every step."""

import json
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from hpcrl.launch.registry import Registry
from hpcrl.net import parse_hostport
from hpcrl.rpc import encode
from hpcrl.rpc.auth import read_token
from hpcrl.rpc.messages import Ping
from hpcrl.rpc.wire import MAGIC
from tests.conftest import REPO
from tests.controller.test_job import metrics_of, wait_for_steps

REQUESTS = 3000
STEPS = 30
PATHS = ["/rpc/train_step", "/rpc/ping", "/rpc/shutdown", "/rpc/nope", "/rpc/", "/rpc/a/b", "/", "/lease", "/x/../rpc"]
VERBS = ["POST", "POST", "POST", "GET", "PUT", "DELETE"]


def request(rng: random.Random, token: str) -> tuple[bytes, bool]:
    """One request's bytes, and whether it carries the right token."""
    authorized = rng.random() < 0.5
    auth = {0: f"Bearer {token}", 1: "Bearer wrong", 2: token, 3: ""}[0 if authorized else rng.randrange(1, 4)]
    body = _body(rng)
    length = len(body)
    kind = rng.randrange(4)
    if kind == 1:  # truncated: says more than it sends
        length = len(body) + rng.randrange(1, 5000)
    elif kind == 2:  # oversized: says more than any server takes
        length = 1 << rng.randrange(34, 62)
    lines = [f"{rng.choice(VERBS)} {rng.choice(PATHS)} HTTP/1.1", "Host: x", f"Content-Length: {length}"]
    if auth:
        lines.append(f"Authorization: {auth}")
    if kind == 3:
        lines.append("Expect: 100-continue")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body, authorized


def _body(rng: random.Random) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randrange(0, 300))
    if choice == 1:  # a plausible prelude, then garbage
        return struct.pack(">4sHIQ", MAGIC, 1, rng.randrange(1 << 16), rng.randrange(1 << 20)) + rng.randbytes(40)
    if choice == 2:  # a real frame, damaged
        frame = bytearray(encode(Ping()))
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        return bytes(frame[: rng.randrange(1, len(frame) + 1)])
    return json.dumps({"controller": rng.choice(["x", 1, None, [], "a" * 5000])}).encode()


def send(address: str, data: bytes) -> int | None:
    """The status the server answers with (None: it closed without one)."""
    host, port = parse_hostport(address)
    try:
        with socket.create_connection((host, port), timeout=2) as conn:
            conn.sendall(data)
            reply = conn.recv(4096)  # a truncated body with the token: the server waits for the rest, in vain
    except OSError:
        return None
    if not reply.startswith(b"HTTP/1.1 "):
        return None
    status = int(reply[9:12])
    if status == 100:  # the interim answer to Expect: the final one follows
        return int(reply.split(b"\r\n\r\n", 1)[1][9:12]) if b"\r\n\r\nHTTP/1.1 " in reply else 100
    return status


@pytest.mark.slow
def test_thousands_of_bad_requests_at_a_running_job_change_nothing(tmp_path):
    cmd = [sys.executable, "-m", "hpcrl.main", f"run.root={tmp_path}", "run.trial=fuzz", f"run.max_steps={STEPS}"]
    cmd += ["eval.stop_at_accuracy=0", "eval.every_steps=0", "rollout.prompts_per_step=16"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "default" / "fuzz"
    try:
        wait_for_steps(proc, run_dir, 2)
        registry = Registry(run_dir / "registry")
        targets = [e.address for e in registry.entries("trainer")]
        targets += [e.extra["lease"] for role in ("server", "trainer") for e in registry.entries(role)]
        token = read_token(run_dir)
        rng = random.Random(7)
        plan = [(rng.choice(targets), *request(rng, token)) for _ in range(REQUESTS)]
        answers: Counter = Counter()
        lock = threading.Lock()

        def fire(part: list) -> None:
            for address, data, authorized in part:
                status = send(address, data)
                with lock:
                    answers[(authorized, status)] += 1

        started = time.monotonic()
        threads = [threading.Thread(target=fire, args=(plan[k::4],)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"{REQUESTS} requests in {time.monotonic() - started:.1f} s: {dict(answers)}")
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == STEPS
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, STEPS + 1)), "every step, once"
    unauthorized = {status for (authorized, status), _ in answers.items() if not authorized}
    assert unauthorized <= {401, None}, f"without the token, only 401 (or a closed connection): {answers}"
    assert all(status is None or status < 500 for (_, status) in answers), answers
    assert sum(n for (authorized, _), n in answers.items() if not authorized) > REQUESTS / 3
