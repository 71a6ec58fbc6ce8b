"""Checks made from a compute node, by tiny Slurm jobs (``jobs.py``) submitted all at once, then read in turn.

    network             this machine listens where the controller would (``probe.listen``); a job runs
                        ``probe connect``: it connects back with the token, listens in turn, and this
                        machine dials it. The two directions a run uses: workers register with the
                        controller's address, the controller dials the workers'
    run root on nodes   a job writes ``<probe folder>/from-node``, in run.root; this machine reads it back
    gpu                 (GPU clusters) a job with one GPU runs ``probe gpu``; its report -> ``gpu.gpu_results``

The jobs ask for what the role they stand in for asks (``role_resources`` of the role as the run starts it:
partition, account, qos, extra sbatch options, setup, env), shrunk to one task and ``PROBE_TIME_MIN``; the
network and storage probes stand in for the servers, the GPU probe for the first role that asks for GPUs (the
servers, the trainer or the critic). They share one deadline; a job still
queued at the deadline makes its check a ``warn`` (not checked), one still running a ``fail``. Every job
is cancelled by id when the checks end, however they end. The probe folder
(``<run.root>/.hpcrl-doctor/<stamp>``: scripts, outputs) is removed unless a check failed.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shlex
import shutil
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

from hpcrl.config.schema import Config
from hpcrl.doctor.gpu import gpu_results, gpu_role, read_report
from hpcrl.doctor.jobs import ProbeJobs, output_tail, probe_script
from hpcrl.doctor.local import run_root, run_specs
from hpcrl.doctor.probe import TIMEOUT_S, listen, read_line, send_line
from hpcrl.doctor.report import Result, fail, ok, warn
from hpcrl.launch.slurm.group import QUEUED_STATES
from hpcrl.launch.slurm.resources import JobResources, role_resources
from hpcrl.launch.slurm.watch import JobState
from hpcrl.net import parse_hostport

PROBE_TIME_MIN = 5  # Slurm time limit of a probe job: importing torch and sglang on a cold node takes a while
ACCEPT_POLL_S = 1.0  # how often the network check looks at its job while it waits for the connection
PENDING_ADVICE = (
    "the queue is busy or the job cannot start (see the reason): raise --job-timeout-s, or see "
    "docs/troubleshooting.md, 'A job stuck PENDING'"
)


def node_checks(cfg: Config, job_prefix: str, timeout_s: float, python: str) -> Iterator[Result]:
    folder = run_root(cfg) / ".hpcrl-doctor" / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    try:
        folder.mkdir(parents=True)
    except OSError as e:
        yield fail("compute nodes", f"no probe jobs: cannot make {folder}: {e}", "fix run.root (see 'run root')")
        return
    probes = [NetworkProbe(cfg, python), StorageProbe(cfg)]
    if gpu_role(cfg) is not None and cfg.cluster.gpus_per_node:
        probes.append(GpuProbe(cfg, python))
    results = []
    with ProbeJobs(folder) as jobs:
        for probe in probes:
            probe.submit(jobs, job_prefix)
        deadline = time.monotonic() + timeout_s
        for probe in probes:
            found = probe.results(jobs, deadline, timeout_s)
            results += found
            yield from found
    if all(r.status != "fail" for r in results):
        shutil.rmtree(folder, ignore_errors=True)
        _remove_if_empty(folder.parent)


class Probe(ABC):
    """One probe job: its script (``body``), submission, and the results read once it has ended (``read``)."""

    name = "probe"  # the job name's suffix and the file names in the probe folder
    check = "probe"  # the check's name in the results

    def __init__(self, cfg: Config, role: str = "server", gpus: int = 0):
        self.cfg = cfg
        self.role = role
        self.gpus = gpus
        self.job_id = ""
        self.error = ""  # why the job could not be submitted
        self.output = Path()

    @abstractmethod
    def body(self, folder: Path) -> list[str]:
        """The shell lines the job runs; ``folder`` is the probe folder."""

    def submit(self, jobs: ProbeJobs, job_prefix: str) -> None:
        self.output = jobs.folder / f"{self.name}.out"
        try:
            resources = self.resources(job_prefix + self.name)
            script = probe_script(resources, self.output, self.body(jobs.folder), self.setup(resources), self.env())
            self.job_id = jobs.submit(self.name, script)
        except (OSError, RuntimeError, ValueError) as e:  # no sbatch, its refusal, resources Slurm cannot be asked
            self.error = str(e)

    def resources(self, name: str) -> JobResources:
        (spec,) = [spec for spec in run_specs(self.cfg) if spec.role == self.role]
        res = role_resources(spec, self.cfg.cluster, name)
        return replace(
            res,
            nodes=1,
            ntasks_per_node=1,
            cpus_per_task=1,
            mem_gb=0.0,
            gpus_per_node=self.gpus,
            time_min=PROBE_TIME_MIN,
        )

    def setup(self, resources: JobResources) -> list[str]:
        return [*self.cfg.cluster.setup, *resources.setup]

    def env(self) -> dict[str, str]:
        settings = self.cfg.cluster.roles.get(self.role)
        return {**self.cfg.cluster.env, **(settings.env if settings else {})}

    def results(self, jobs: ProbeJobs, deadline: float, timeout_s: float) -> list[Result]:
        if self.error:
            return [fail(self.check, f"could not submit the probe job: {self.error}", "see the sbatch lines above")]
        state = jobs.wait(self.job_id, deadline)
        if not state.final:
            return [self.unfinished(state, timeout_s)]
        return self.read(state, jobs)

    @abstractmethod
    def read(self, state: JobState, jobs: ProbeJobs) -> list[Result]:
        """The results, from the job's files and its final ``state``."""

    def unfinished(self, state: JobState, timeout_s: float) -> Result:
        where = f"probe job {self.job_id} is still {state} after {timeout_s:g} s"
        if state.state in QUEUED_STATES:
            return warn(self.check, f"not checked: {where}", PENDING_ADVICE)
        return fail(self.check, where, f"it hangs: look at {self.output} and at the node")

    def job_failed(self, state: JobState, advice: str) -> Result:
        return fail(self.check, f"probe job {self.job_id} ended {state}: {output_tail(self.output)}", advice)


class StorageProbe(Probe):
    """A compute node writes a file into run.root; this machine must read it: the run directory is shared."""

    name = "storage"
    check = "run root on nodes"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.token = secrets.token_hex(8)

    def body(self, folder: Path) -> list[str]:
        node = "${SLURMD_NODENAME:-$(hostname)}"  # Slurm's node name: virtual nodes may share a host name
        return [f'printf "%s %s\\n" {self.token} "{node}" > {shlex.quote(str(folder / "from-node"))}']

    def read(self, state: JobState, jobs: ProbeJobs) -> list[Result]:
        marker = jobs.folder / "from-node"
        shared = "put run.root on a filesystem every node mounts at the same path (home, project or scratch)"
        if state.state != "COMPLETED":
            return [self.job_failed(state, f"its node could not write to {jobs.folder}: {shared}")]
        text = marker.read_text().split() if marker.exists() else []
        if text[:1] != [self.token]:
            found = f"probe job {self.job_id} completed, but its file {marker} is not here"
            return [fail(self.check, f"{found}: run.root is not the same directory on the node", shared)]
        node = text[1] if len(text) > 1 else "?"
        return [ok(self.check, f"node {node} wrote {marker}, and this machine read it")]


class NetworkProbe(Probe):
    """Node -> controller and controller -> node, on the addresses and ports cluster.net gives."""

    name = "network"
    check = "network"

    def __init__(self, cfg: Config, python: str):
        super().__init__(cfg)
        self.python = python
        self.token = secrets.token_hex(16)
        self.server: socket.socket | None = None
        self.address = ""

    def submit(self, jobs: ProbeJobs, job_prefix: str) -> None:
        try:  # listening before the job exists, so that it cannot come too early
            self.server, self.address = listen(self.cfg.cluster.net)
        except (OSError, RuntimeError, ValueError) as e:  # no free port, a missing interface
            self.error = f"cannot listen where the controller would: {e}"
            return
        super().submit(jobs, job_prefix)

    def body(self, folder: Path) -> list[str]:
        host, port = parse_hostport(self.address)
        net = json.dumps(asdict(self.cfg.cluster.net))
        argv = [self.python, "-m", "hpcrl.doctor.probe", "connect", host, str(port), self.token, "--net", net]
        return [shlex.join(argv)]

    def results(self, jobs: ProbeJobs, deadline: float, timeout_s: float) -> list[Result]:
        if self.server is not None:
            with self.server:  # closed on every path
                if not self.error:
                    return [self._accept(self.server, jobs, deadline, timeout_s)]
        return super().results(jobs, deadline, timeout_s)

    def read(self, state: JobState, jobs: ProbeJobs) -> list[Result]:
        return [self.job_failed(state, self._advice())]  # the job ended, and never connected

    def _accept(self, server: socket.socket, jobs: ProbeJobs, deadline: float, timeout_s: float) -> Result:
        """Wait for the probe's hello (while its job lives, until the deadline), then dial the node back."""
        server.settimeout(ACCEPT_POLL_S)
        while True:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                state = jobs.state(self.job_id)
                if state.final:
                    return self.read(state, jobs)[0]
                if time.monotonic() >= deadline:
                    return self._not_reached(state, timeout_s)
                continue
            with conn:
                hello = self._hello(conn)
            if hello is not None:
                return self._dial_back(hello)

    def _hello(self, conn: socket.socket) -> dict | None:
        """The probe's hello, or None for a connection that is not the probe's (it brings no token)."""
        conn.settimeout(TIMEOUT_S)
        try:
            hello = read_line(conn)
        except (OSError, ValueError):
            return None
        return hello if isinstance(hello, dict) and hello.get("token") == self.token else None

    def _dial_back(self, hello: dict) -> Result:
        node, address = hello.get("node", "?"), str(hello.get("address", ""))
        reached = f"node {node} reached this machine at {self.address}"
        try:
            with socket.create_connection(parse_hostport(address), timeout=TIMEOUT_S) as conn:
                conn.settimeout(TIMEOUT_S)
                send_line(conn, {"token": self.token})
                answer = read_line(conn)
        except (OSError, ValueError) as e:
            return fail(
                self.check,
                f"{reached}, but this machine cannot reach the node at {address}: {e}",
                "the controller must reach the workers too: set cluster.net.interface to the NIC both share, "
                "or open the port range cluster.net.port_min..port_max in the firewall",
            )
        if answer != {"ok": True}:
            return fail(self.check, f"{reached}; the node at {address} answered {answer!r}", "see the probe's output")
        return ok(self.check, f"{reached}, and this machine reached node {node} at {address}")

    def _not_reached(self, state: JobState, timeout_s: float) -> Result:
        if state.state in QUEUED_STATES:
            return self.unfinished(state, timeout_s)
        return fail(self.check, f"no node reached {self.address} within {timeout_s:g} s", self._advice())

    def _advice(self) -> str:
        return (
            f"nodes must reach {self.address}: set cluster.net.interface (or advertise_host) to an address of "
            "this machine on the nodes' network, check cluster.net.family (IPv4/IPv6), or open the port range"
        )


class GpuProbe(Probe):
    """nvidia-smi, torch CUDA and import sglang on a node of the first role that asks for GPUs."""

    name = "gpu"
    check = "gpu"

    def __init__(self, cfg: Config, python: str):
        super().__init__(cfg, role=gpu_role(cfg) or "server", gpus=1)
        self.python = python

    def body(self, folder: Path) -> list[str]:
        return [shlex.join([self.python, "-m", "hpcrl.doctor.probe", "gpu"])]

    def read(self, state: JobState, jobs: ProbeJobs) -> list[Result]:
        report = read_report(self.output.read_text()) if self.output.exists() else None
        if report is None:
            advice = "run the probe by hand on a GPU node: python -m hpcrl.doctor.probe gpu"
            return [self.job_failed(state, advice)]
        return list(gpu_results(report, self.cfg, f"node {report.get('node', '?')}"))


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty: another doctor run's folder, or one kept for a failed check
        folder.rmdir()
