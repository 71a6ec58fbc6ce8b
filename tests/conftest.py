import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "hpcrl" / "conf"

# The suite runs three jobs at a time on two cores (pyproject's -n 3): a trainer rank's OpenMP threads, spinning at
# each barrier while another job holds the core they wait for, burned two thirds of the CPU of two concurrent
# REINFORCE++ jobs (80 CPU-s each against 26 with passive waits; 175 s against 61 s of wall time). Every process
# the tests start inherits this; a value set outside the suite is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_main(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m hpcrl.main ARGS`` as a user would, capturing its output."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.main", *args],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def main_cli(tmp_path):
    """``python -m hpcrl.main`` with run.root in a temporary directory."""

    def call(*args: str) -> subprocess.CompletedProcess:
        return run_main(*args, f"run.root={tmp_path}", cwd=tmp_path)

    return call


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Qwen2 model and character tokenizer, made once per test session."""
    from hpcrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


def run_torchrun(argv: list[str], timeout_s: float, describe: str = "torchrun") -> str:
    """Run ``argv`` (a torchrun command) to completion in its own session; its output, or a test failure.

    In its own session, so that on a timeout the whole group (torchrun and its ranks) is killed at once.
    """
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{describe} hung for {timeout_s} s:\n{output[-6000:]}")
    assert proc.returncode == 0, f"{describe} failed:\n{output[-6000:]}"
    return output


# the tests that use the test Slurm: under pytest-xdist (pyproject's addopts: -n 3) they run one after another in
# one worker, as they share its nodes (most of their time is waiting on Slurm); every other test is spread over the
# workers beside them
SLURM_TESTS = ("tests/slurm/", "tests/doctor/test_slurm.py")
# modules whose tests share one costly module fixture (torchrun launches): one worker runs all of a module's tests,
# or every worker that gets one of them launches the fixture's runs again (70 s each for test_engine_fsdp.py);
# test_package.py's wheel too, which two workers must not build at once (setuptools builds in the tree's build/, and
# one of two concurrent builds fails on the other's files: CI saw it)
SHARED_FIXTURE_MODULES = (
    "tests/train/test_engine_fsdp.py",
    "tests/train/test_value_engine.py",
    "tests/test_package.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by scope, with one scope for the Slurm tests, one per module of SHARED_FIXTURE_MODULES and
    one per test for the rest (xdist's own ``xdist_group`` marks do not reach its scheduler under pytest 9.2, which
    keeps the node id elsewhere)."""
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(SLURM_TESTS):
                return "slurm"
            module = nodeid.split("::")[0]
            return module if module in SHARED_FIXTURE_MODULES else nodeid

    return SlurmTestsTogether(config, log)


def user_error(result: subprocess.CompletedProcess) -> list[str]:
    """How an entry point ended on a user error (``hpcrl.errors``): exit code 2, no traceback, and its last lines
    from the one that starts with ``hpcrl:``: that one line, and the hint after it when it has one."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("hpcrl:"))
    assert len(lines) - start <= 2, result.stderr[-3000:]
    return lines[start:]


# Slurm's client commands: a machine without Slurm has none of them
SLURM_COMMANDS = {"sbatch", "srun", "salloc", "squeue", "scancel", "sinfo", "sacct", "scontrol", "sstat", "sattach"}


@pytest.fixture(scope="session")
def path_without_slurm(tmp_path_factory) -> str:
    """A PATH of one directory linking every command on this PATH but Slurm's: this machine without Slurm, even
    where Slurm is installed beside the other commands (/usr/bin)."""
    bin_dir = tmp_path_factory.mktemp("bin-without-slurm")
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            link = bin_dir / entry.name
            found = os.access(entry.path, os.X_OK) and not entry.is_dir()
            if found and entry.name not in SLURM_COMMANDS and not os.path.lexists(link):  # the first on PATH wins
                link.symlink_to(entry.path)
    return str(bin_dir)


def subnormals_computed() -> bool:
    """Whether this process still computes with subnormal floats: a flush-to-zero mode (``hpcrl/denormals.py``,
    which trainer ranks and CPU servers set for themselves) makes half the smallest normal float 0."""
    smallest = sys.float_info.min
    return smallest / 2 > 0


@pytest.fixture(autouse=True)
def no_flush_to_zero_left_behind(request):
    """A test that sets the flush-to-zero mode in the test process and leaves it set fails here, by name: the mode
    is the process's, and a later test in the same worker (hypothesis's float strategies) would fail instead."""
    yield
    if not subnormals_computed():
        pytest.fail(f"{request.node.nodeid} left subnormal floats flushed to zero in the test process", pytrace=False)
