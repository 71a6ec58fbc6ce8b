import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from hpcrl.launch.process import spawn
from hpcrl.models.tiny import make_tiny_model
from hpcrl.net import PortAllocator, format_hostport


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory):
    """The same architecture with other weights (another seed): a weight update must show."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-b"), seed=1)


_ports = PortAllocator(rank=0, world_size=1)


def free_port() -> int:
    return _ports.allocate(1)[0]


class ServerProc:
    """A real ``python -m hpcrl.inference.server`` child process and plain-HTTP helpers for tests."""

    def __init__(self, model, log_file, host="127.0.0.1", *extra: str, env: dict[str, str] | None = None):
        self.model = model
        self.port = free_port()
        self.address = format_hostport(host, self.port)
        self.url = f"http://{self.address}"
        cmd = [sys.executable, "-m", "hpcrl.inference.server", "--model-path", str(model), "--host", host]
        self.child = spawn("server", [*cmd, "--port", str(self.port), *extra], log_file, env=env)
        self.wait_healthy(120)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.child.check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server {self.address} not healthy in {timeout_s} s:\n{self.child.log_tail()}")

    def post(self, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, object]:
        data = json.dumps(body if body is not None else {}).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, _decode(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _decode(e.read())

    def get(self, path: str) -> tuple[int, object]:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as r:
            return r.status, _decode(r.read())

    def generate_many(self, bodies: list[dict]) -> list[dict]:
        """Send the bodies concurrently (so the server batches them); answers in order."""
        with ThreadPoolExecutor(len(bodies)) as pool:
            results = list(pool.map(lambda b: self.post("/generate", b), bodies))
        assert all(status == 200 for status, _ in results), results
        return [answer for _, answer in results]

    def stop(self) -> None:
        self.child.stop(grace_s=5)


def _decode(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One server for a module's tests that leave its weights alone."""
    proc = ServerProc(tiny_model, tmp_path_factory.mktemp("server") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A server of a tiny model with room for thousands of new tokens, for tests that interrupt requests."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_positions=8192)
    proc = ServerProc(model, tmp_path_factory.mktemp("long-server") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture
def fresh_server(tiny_model, tmp_path):
    """A server of its own, for a test that changes its weights."""
    proc = ServerProc(tiny_model, tmp_path / "server.log")
    yield proc
    proc.stop()
