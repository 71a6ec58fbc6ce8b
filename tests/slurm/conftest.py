"""The real test Slurm for tests marked ``slurm``, and helpers to run jobs on it.

``slurm_cluster`` (one per session) uses a Slurm that already answers with its partition's nodes idle;
otherwise it starts one with ``slurm/dev-cluster.sh up`` (as root: the first time it installs Debian's
packages) and stops that one again with ``down`` when the session ends. Without root, or where the packages
cannot be installed, the tests are skipped, except in CI (``CI=true``), where they fail instead.

Every job a test submits is named with its ``job_prefix`` (``hpcrl-test-...``); after each test,
``no_leftover_jobs`` cancels (by job id) whatever of those is still queued or running, and fails the test.
"""

import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpcrl.launch.slurm.watch import FINAL_STATES

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "dev-cluster.sh"
PARTITION = os.environ.get("HPCRL_SLURM_PARTITION", "debug")
JOB_PREFIX = "hpcrl-test-"
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
# the first `up` installs packages: about 15 s here, more on a slow mirror; pytest-timeout (600 s) covers
# this setup and the first test together
UP_TIMEOUT_S = 480
DOWN_TIMEOUT_S = 120
# CPUs each node declares when this fixture starts the cluster: several small jobs fit on a 2-core machine
DEFAULT_CPUS_PER_NODE = "4"
# nodes the tests need (dev-cluster.sh's default): a hetjob's components never share a node
MIN_NODES = 4


@dataclass(frozen=True)
class SlurmCluster:
    partition: str
    nodes: tuple[str, ...]
    started_here: bool


def _run(argv: list[str], timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def _node_states(partition: str) -> dict[str, str] | str:
    """The partition's nodes and their sinfo states, or why there are none."""
    if shutil.which("sinfo") is None:
        return "sinfo is not installed"
    try:
        # at once, where sinfo would retry for about 10 s when no slurmctld answers
        ping = _run(["scontrol", "ping"], timeout_s=15)
        if ping.returncode != 0:
            return f"no slurmctld answers ({(ping.stdout.strip().splitlines() or ['scontrol ping failed'])[0]})"
        result = _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t"], timeout_s=15)
    except subprocess.TimeoutExpired as exc:
        return f"{exc.cmd[0]} did not answer within 15 s"
    if result.returncode != 0:
        return f"sinfo failed: {result.stderr.strip()}"
    states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
    return states or f"sinfo shows no nodes in partition {partition!r}"


def _ready(partition: str) -> tuple[str, ...] | str:
    """The partition's nodes when every one of them is up (idle, or busy with jobs); otherwise why not."""
    states = _node_states(partition)
    if isinstance(states, str):
        return states
    if not all(state in {"idle", "mix", "alloc"} for state in states.values()):
        return f"not every node is idle: {states}"
    return tuple(sorted(states))


def _skip_or_fail(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: the slurm tests must run there, not be skipped)", pytrace=False)
    pytest.skip(reason)


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _dev_cluster(command: str, timeout_s: float, **defaults: str) -> tuple[int | None, str]:
    """Run ``slurm/dev-cluster.sh COMMAND`` (DEFAULTS: settings where the environment has none); its exit
    status (None on a timeout) and its output."""
    env = {**defaults, **os.environ, "HPCRL_SLURM_PARTITION": PARTITION}
    try:
        result = subprocess.run(
            ["bash", str(SCRIPT), command], capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        return None, _text(exc.stdout) + _text(exc.stderr)
    return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope="session")
def slurm_cluster():
    """A Slurm whose partition has every node idle; started (and stopped at the end) only if none runs."""
    found = _ready(PARTITION)
    if not isinstance(found, str):
        _need_shape(found)
        yield SlurmCluster(PARTITION, found, started_here=False)
        return
    if os.geteuid() != 0:
        _skip_or_fail(f"no test Slurm runs ({found}), and only root can start one with {SCRIPT.relative_to(REPO)}")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        _skip_or_fail("no test Slurm runs, its packages are not installed, and there is no apt-get to install them")
    # a cluster that an earlier `up` started and that is not ready (a node drained, say): `up` mends it, with
    # the settings of the environment, and it is not this session's to stop
    _status_rc, status = _dev_cluster("status", 30)
    started_here = re.search(r"^slurmctld +running", status, re.MULTILINE) is None
    defaults = {"HPCRL_SLURM_CPUS": DEFAULT_CPUS_PER_NODE} if started_here else {}
    rc, output = _dev_cluster("up", UP_TIMEOUT_S, **defaults)
    if rc != 0:
        down_output = "(left running: this session did not start it)"
        if started_here:  # stop what the failed attempt did start (down acts only on the PIDs up recorded)
            down_output = _dev_cluster("down", DOWN_TIMEOUT_S)[1]
        what = f"did not finish within {UP_TIMEOUT_S} s" if rc is None else f"failed with exit status {rc}"
        message = f"slurm/dev-cluster.sh up {what}:\n{output}\n--- down:\n{down_output}"
        if rc == 3:  # the script's status for "the packages are missing and cannot be installed"
            _skip_or_fail(message)
        pytest.fail(message, pytrace=False)
    found = _ready(PARTITION)
    if isinstance(found, str):
        if started_here:
            _dev_cluster("down", DOWN_TIMEOUT_S)
        pytest.fail(f"slurm/dev-cluster.sh up succeeded, yet {found}:\n{output}", pytrace=False)
    try:
        yield SlurmCluster(PARTITION, found, started_here=started_here)
    finally:
        if started_here:
            rc, output = _dev_cluster("down", DOWN_TIMEOUT_S)
            if rc != 0:
                pytest.fail(f"slurm/dev-cluster.sh down failed (exit status {rc}):\n{output}", pytrace=False)


def _need_shape(nodes: tuple[str, ...]) -> None:
    """A cluster found running must have the nodes, and declare the CPUs a node, that the fixture would start (a
    controller job asks for 4 CPUs)."""
    out = _run(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %c"]).stdout
    cpus = {name: int(count) for name, count in (line.split() for line in out.splitlines() if line.strip())}
    few = {n: c for n, c in cpus.items() if n in nodes and c < int(DEFAULT_CPUS_PER_NODE)}
    if len(nodes) < MIN_NODES:
        pytest.fail(
            f"the test Slurm found running has {len(nodes)} nodes; the tests need {MIN_NODES} (a whole run as one "
            f"hetjob with a critic has {MIN_NODES} components): restart it with {SCRIPT.relative_to(REPO)} up "
            "(after down)",
            pytrace=False,
        )
    if few:
        pytest.fail(
            f"the test Slurm found running declares {few} CPUs a node; the tests need {DEFAULT_CPUS_PER_NODE}: "
            f"restart it with HPCRL_SLURM_CPUS={DEFAULT_CPUS_PER_NODE} {SCRIPT.relative_to(REPO)} up (after down)",
            pytrace=False,
        )


@pytest.fixture
def job_prefix(request) -> str:
    """The start of the name of every job this test submits: ``hpcrl-test-<test>-<random>-``."""
    test = re.sub(r"[^A-Za-z0-9_]+", "_", request.node.name.removeprefix("test_"))[:40]
    return f"{JOB_PREFIX}{test}-{secrets.token_hex(3)}-"


def _queued(prefix: str) -> list[tuple[str, str, str]]:
    """(job id, name, state) of every job in squeue whose name starts with PREFIX."""
    result = _run(["squeue", "-h", "-a", "-o", "%i|%j|%T"])
    if result.returncode != 0:
        pytest.fail(f"squeue failed: {result.stderr.strip()}", pytrace=False)
    jobs = [tuple(line.split("|", 2)) for line in result.stdout.splitlines() if line.strip()]
    return [job for job in jobs if job[1].startswith(prefix)]


@pytest.fixture(autouse=True)
def no_leftover_jobs(request, job_prefix):
    """After a slurm test: no job named with its prefix may be left queued or running (they are cancelled)."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    request.getfixturevalue("slurm_cluster")
    yield
    deadline = time.monotonic() + 15
    left = _queued(job_prefix)
    # a job that has just ended is still COMPLETING for a moment: that is not a leftover
    while left and all(state == "COMPLETING" for _, _, state in left) and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _queued(job_prefix)
    if not left:
        return
    # by id, never by name: "123+1" (a heterogeneous job's component) and "123_4" (an array task) go with 123
    for job_id in sorted({re.split(r"[+_]", job_id)[0] for job_id, _, _ in left}):
        _run(["scancel", job_id])
    while _queued(job_prefix) and time.monotonic() < deadline + 15:
        time.sleep(0.2)
    pytest.fail(f"the test left jobs in Slurm (now cancelled): {left}", pytrace=False)


def sbatch(script: str, *, name: str, workdir: Path, args: tuple[str, ...] = ()) -> str:
    """Submit the batch SCRIPT as job NAME, run in WORKDIR, output to WORKDIR/NAME.out; its job id."""
    path = workdir / f"{name}.sbatch"
    path.write_text(script)
    result = _run(
        [
            "sbatch",
            "--parsable",
            f"--job-name={name}",
            f"--partition={PARTITION}",
            f"--chdir={workdir}",
            f"--output={workdir / name}.out",
            *args,
            str(path),
        ]
    )
    assert result.returncode == 0, f"sbatch failed: {result.stderr}"
    return result.stdout.strip().split(";")[0]


def sacct(job_id: str) -> dict[str, dict[str, str]]:
    """sacct's rows for JOB_ID (its allocation, ``ID+N`` components, and steps), by their JobID."""
    fields = ["JobID", "JobName", "State", "ExitCode", "NodeList"]
    result = _run(["sacct", "-j", job_id, "-n", "-P", "-o", ",".join(fields)])
    assert result.returncode == 0, f"sacct failed: {result.stderr}"
    rows = [dict(zip(fields, line.split("|"), strict=True)) for line in result.stdout.splitlines() if line]
    return {row["JobID"]: row for row in rows}


def wait_for_job(job_id: str, timeout_s: float = 60, components: int = 1) -> dict[str, dict[str, str]]:
    """Poll sacct until JOB_ID (with that many heterogeneous components) has ended; its rows.

    After the deadline the job is cancelled and the test fails.
    """
    allocation = re.compile(rf"{re.escape(job_id)}(\+\d+)?")
    deadline = time.monotonic() + timeout_s
    while True:
        rows = sacct(job_id)
        allocations = [row for key, row in rows.items() if allocation.fullmatch(key)]
        if len(allocations) >= components and all(row["State"].split()[0] in FINAL_STATES for row in allocations):
            return rows
        if time.monotonic() > deadline:
            _run(["scancel", job_id])
            queue = _run(["squeue", "-a"]).stdout
            pytest.fail(f"job {job_id} has not ended after {timeout_s} s (now cancelled): {rows}\n{queue}")
        time.sleep(0.5)


def wait_for_state(job_id: str, state: str, timeout_s: float = 30) -> None:
    """Wait until squeue shows JOB_ID (all its components) in STATE, for example RUNNING; fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
        if set(result.stdout.split()) == {state}:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} not {state} after {timeout_s} s: {result.stdout.strip() or result.stderr}")
        time.sleep(0.2)


RELEASE_AFTER_S = 3.0  # after a requeue: the credential's revocation is by the second


def release_when_requeued(job_id: str, timeout_s: float = 300) -> threading.Thread:
    """Once JOB_ID is requeued, let it start soon: Slurm holds a requeued job for a fixed 2 minutes (PENDING,
    reason BeginTime), which tests have no need to wait out. Not at once: the node revoked the job's credential
    when it was requeued, and one issued within the same second is refused ("Job credential revoked", the job
    FAILED), so it is released RELEASE_AFTER_S later. Runs on a thread of its own."""

    def release() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = _run(["squeue", "-h", "-j", job_id, "-o", "%T %r"]).stdout.split()
            if state == ["PENDING", "BeginTime"]:
                time.sleep(RELEASE_AFTER_S)
                _run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
                return
            time.sleep(0.5)

    thread = threading.Thread(target=release, name=f"release-{job_id}", daemon=True)
    thread.start()
    return thread
