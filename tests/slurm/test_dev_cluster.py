"""The test Slurm (slurm/dev-cluster.sh) does what hpcrl's Slurm tests rely on: nodes that are hosts of their
own on the network, batch jobs, accounting, heterogeneous jobs, submitit, cancellation."""

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.slurm.conftest import sacct, sbatch, wait_for_job, wait_for_state

pytestmark = pytest.mark.slurm


def test_sinfo_shows_idle_nodes_whose_names_resolve(slurm_cluster):
    result = subprocess.run(
        ["sinfo", "-h", "-N", "-p", slurm_cluster.partition, "-o", "%N %t"],
        capture_output=True,
        text=True,
        timeout=15,
        check=True,
    )
    idle = [line.split()[0] for line in result.stdout.splitlines() if line.split()[1:] == ["idle"]]
    assert len(idle) >= 2, result.stdout
    for node in idle:
        socket.gethostbyname(node)  # node names must resolve: submitit and torchrun use them as addresses


def test_batch_job_completes_in_sacct(slurm_cluster, job_prefix, tmp_path):
    name = f"{job_prefix}batch"
    job_id = sbatch("#!/bin/bash\necho hello from $SLURMD_NODENAME\n", name=name, workdir=tmp_path)
    rows = wait_for_job(job_id)
    assert rows[job_id]["State"] == "COMPLETED", rows
    assert rows[job_id]["ExitCode"] == "0:0", rows
    node = (tmp_path / f"{name}.out").read_text().split()[-1]
    assert node in slurm_cluster.nodes


def test_heterogeneous_job_runs_on_two_nodes(slurm_cluster, job_prefix, tmp_path):
    name = f"{job_prefix}het"
    script = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH hetjob
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
srun --het-group=0,1 hostname
srun --het-group=0,1 bash -c 'echo "node $SLURM_HET_JOB_ID+$SLURM_HET_JOB_OFFSET $SLURMD_NODENAME"'
"""
    job_id = sbatch(script, name=name, workdir=tmp_path)
    rows = wait_for_job(job_id, components=2)
    for component in (f"{job_id}+0", f"{job_id}+1"):
        assert rows[component]["State"] == "COMPLETED", rows
        assert rows[component]["ExitCode"] == "0:0", rows
    assert rows[f"{job_id}+0"]["NodeList"] != rows[f"{job_id}+1"]["NodeList"], rows
    # srun's own notes ("step creation temporarily disabled ...", while the first step's cleanup still holds
    # the nodes) share the output file with the steps' lines; they are not the steps' output
    lines = [line for line in (tmp_path / f"{name}.out").read_text().splitlines() if not line.startswith("srun: ")]
    assert len([line for line in lines if not line.startswith("node ")]) == 2, lines  # hostname, once per component
    nodes = {line.split()[-1] for line in lines if line.startswith("node ")}
    assert len(nodes) == 2 and nodes <= set(slurm_cluster.nodes), lines


def test_submitit_job_returns_its_result(slurm_cluster, job_prefix, tmp_path):
    submitit = pytest.importorskip("submitit")

    def where_am_i(a: int, b: int) -> tuple[int, str | None, str | None]:
        # defined here, so that it travels by value: the job need not import this test module
        return a + b, os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURMD_NODENAME")

    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(
        name=f"{job_prefix}submitit",
        # submitit asks for USR2 90 s before the time limit, and Slurm may send it up to 60 s earlier than asked
        # (sbatch --signal), so a 2-minute job could be signalled as it starts
        timeout_min=5,
        slurm_partition=slurm_cluster.partition,
        cpus_per_task=1,
        mem_gb=1,
    )
    job = executor.submit(where_am_i, 2, 3)
    deadline = time.monotonic() + 60
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel()
            pytest.fail(f"submitit job {job.job_id} not done after 60 s (state {job.state})")
        time.sleep(0.5)
    total, slurm_job_id, node = job.result()
    assert (total, slurm_job_id) == (5, job.job_id)
    assert node in slurm_cluster.nodes
    # the result is there a moment before the job ends in Slurm: wait for that too
    rows = wait_for_job(job.job_id)
    assert rows[job.job_id]["State"] == "COMPLETED", rows


def test_cancelled_job_is_cancelled_in_sacct(slurm_cluster, job_prefix, tmp_path):
    job_id = sbatch("#!/bin/bash\nsleep 300\n", name=f"{job_prefix}cancel", workdir=tmp_path, args=("--time=5",))
    wait_for_state(job_id, "RUNNING")
    subprocess.run(["scancel", job_id], check=True, timeout=15)
    rows = wait_for_job(job_id, timeout_s=30)
    assert rows[job_id]["State"].split()[0] == "CANCELLED", rows
    assert sacct(job_id)[job_id]["State"].startswith("CANCELLED")


def _srun(node: str, code: str, job_name: str, **kwargs) -> subprocess.Popen:
    """``python3 -c CODE`` as a one-task step on NODE (its stdout to a pipe)."""
    argv = ["srun", f"--job-name={job_name}", "-w", node, "-N1", "-n1", "--time=2", sys.executable, "-c", code]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _output(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err
    return out.strip()


def test_every_node_is_a_host_of_its_own(slurm_cluster, job_prefix):
    """Its own host name, its own addresses only (IPv4 and IPv6), and names that resolve to them everywhere."""
    show = (
        "import socket, psutil\n"
        "mine = sorted(a.address for ifs in psutil.net_if_addrs().values() for a in ifs"
        " if a.family in (socket.AF_INET, socket.AF_INET6) and not a.address.startswith(('127.', '::1', 'fe80')))\n"
        "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), ' '.join(mine))"
    )
    seen = {}
    for node in slurm_cluster.nodes:
        name, resolved, *addresses = _output(_srun(node, show, f"{job_prefix}whoami")).split()
        assert name == node and resolved == socket.gethostbyname(node), (node, name, resolved)
        assert len(addresses) == 2 and resolved in addresses, addresses  # one IPv4, one IPv6, nothing of the host's
        seen[node] = addresses
    assert len({a for addresses in seen.values() for a in addresses}) == 2 * len(seen), seen


def test_loopback_is_per_node_and_nodes_reach_each_other_by_name_and_ipv6(slurm_cluster, job_prefix):
    first, second = slurm_cluster.nodes[:2]
    port = 24555
    serve = (  # never accepts: a connection completes in the listen backlog, which is all a dial needs
        "import socket, time\n"
        f"lo = socket.create_server(('127.0.0.1', {port}), backlog=16)\n"
        f"anywhere = socket.create_server(('::', {port + 1}), family=socket.AF_INET6, dualstack_ipv6=True)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    server = _srun(first, serve, f"{job_prefix}serve")
    try:
        assert server.stdout.readline().strip() == "ready", server.stderr.read()
        first_v6 = _output(_srun(first, "import psutil,socket; print([a.address for a in psutil.net_if_addrs()"
                                 "['hpcrl0'] if a.family == socket.AF_INET6 and a.address.startswith('fd')][0])",
                                 f"{job_prefix}v6"))  # fmt: skip
        probe = (
            "import socket\n"
            "def dial(host, port):\n"
            "    try:\n"
            "        socket.create_connection((host, port), timeout=5).close()\n"
            "        return 'ok'\n"
            "    except OSError as e:\n"
            "        return type(e).__name__\n"
            f"print(dial('127.0.0.1', {port}), dial('{first}', {port + 1}), dial('{first_v6}', {port + 1}))"
        )
        # from the second node, 127.0.0.1 is its own loopback, where nothing listens
        assert _output(_srun(second, probe, f"{job_prefix}probe")).split() == ["ConnectionRefusedError", "ok", "ok"]
        assert _output(_srun(first, probe, f"{job_prefix}lo")).split() == ["ok", "ok", "ok"]  # its own loopback
    finally:
        # SIGTERM, which srun passes to the task and then ends the job it made; a SIGKILLed srun leaves the job
        # running until its task ends on its own (the test's leftover-jobs check saw that on a slow machine)
        server.terminate()
        server.wait(30)
