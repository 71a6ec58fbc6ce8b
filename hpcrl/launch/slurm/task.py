"""What one Slurm task of a role runs: ``WorkerTask``, a pickled callable that becomes the worker.

The controller pickles one ``WorkerTask`` per role (submitit's ``DelayedSubmission``); every task of
the role's srun step loads it and calls it, and the call ``exec``s the worker in the same process, so
Slurm signals and watches the worker itself:

    plain role:    task i of the step  -> HPCRL_RANK=i (SLURM_PROCID), output to logs/<role>-<i>.log,
                                          GPUs: its own slice of the node's CUDA_VISIBLE_DEVICES
    a fleet's job: its one task        -> HPCRL_RANK=k, the task's fixed ``rank`` (fleet.py: a job per worker)
    torchrun role: one task per node   -> torchrun --nnodes=N --nproc-per-node=W/N, c10d rendezvous on the
                                          first node of the step, at a port chosen there (rendezvous.py);
                                          ranks start through
                                          ``python -m hpcrl.launch.local --rank-log`` (logs/<role>-<rank>.log)
                                          and torchrun's own output stays in the job's output files

``per_role`` jobs call it through submitit (``python -m submitit.core._submit FOLDER``); hetjob
components through ``python -m hpcrl.launch.slurm PICKLE`` (``__main__.py``): submitit finds its pickle by
``SLURM_JOB_ID``, which in the step of every component is the leader's id, so all components would
read one pickle.

The job's time-limit warning (submitit's ``--signal=USR2@90``) is ignored by the worker, which knows
nothing of submitit: it runs until Slurm ends the job at its limit, and the job ends as TIMEOUT.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from hpcrl.launch.local import torchrun_command
from hpcrl.launch.slots import RANK_ENV
from hpcrl.launch.slurm.rendezvous import RendezvousPlan, rendezvous_port, step_key
from hpcrl.net import format_hostport

GPU_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class WorkerTask:
    """One role's program and environment, as every task of the role's srun step runs it."""

    role: str  # the role, for log names
    argv: list[str]  # the program of one worker (under torchrun: of one rank)
    env: dict[str, str]  # the worker environment, without its rank
    logs: Path  # the run directory's logs/ folder
    workers: int  # workers of the role (under torchrun: ranks)
    nodes: int  # nodes of the role
    gpus_per_worker: int = 0  # GPUs each worker owns
    torchrun: bool = False  # one torchrun per node, instead of one task per worker
    rendezvous: RendezvousPlan | None = None  # torchrun: where its c10d rendezvous port comes from
    cwd: str = field(default_factory=os.getcwd)  # where the worker starts (the controller's directory)
    rank: int | None = None  # the worker's rank, fixed: the one worker of a fleet's job; None = SLURM_PROCID

    def __call__(self) -> None:
        exec_worker(self, os.environ)


def exec_worker(task: WorkerTask, environ: dict[str, str] | os._Environ) -> NoReturn:
    """Become this Slurm task's worker (or torchrun), with its environment and log file."""
    env = {**environ, **task.env}
    if task.torchrun:
        argv, log_file = torchrun_argv(task, environ), None
    else:
        rank = task.rank if task.rank is not None else int(_need(environ, "SLURM_PROCID"))
        env[RANK_ENV] = str(rank)
        env.update(_gpu_env(task, environ))
        argv, log_file = task.argv, task.logs / f"{task.role}-{rank}.log"
    if task.torchrun and GPU_ENV not in task.env and not task.gpus_per_worker:
        env[GPU_ENV] = ""  # a role that asked for no GPU sees none, as under the local scheduler
    if os.path.isdir(task.cwd):
        os.chdir(task.cwd)
    # the warning before the time limit is for submitit's own jobs; SIG_IGN survives exec, a handler does not
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if log_file is not None:
        _redirect(log_file, f"{task.role} {env[RANK_ENV]}", argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"hpcrl: cannot start {shlex.join(argv)}: {e}", file=sys.stderr, flush=True)
        os._exit(127)


def torchrun_argv(task: WorkerTask, environ: dict[str, str] | os._Environ) -> list[str]:
    """torchrun for this node: N nodes, W/N ranks each, rendezvous on the first node of the step at a port
    chosen there."""
    hosts = expand_hostlist(environ.get("SLURM_STEP_NODELIST") or _need(environ, "SLURM_JOB_NODELIST"))
    if len(hosts) != task.nodes:
        raise RuntimeError(f"{task.role}: the step runs on {hosts}, expected {task.nodes} nodes")
    if task.rendezvous is None:
        raise RuntimeError(f"{task.role}: a torchrun WorkerTask needs its RendezvousPlan")
    is_host = int(_need(environ, "SLURMD_NODENAME") == hosts[0])
    port = rendezvous_port(task.rendezvous, step_key(environ), first_node=bool(is_host))
    rank_log = str(task.logs / f"{task.role}-{{rank}}.log")
    return torchrun_command(
        task.argv,
        task.workers // task.nodes,
        format_hostport(hosts[0], port),
        rank_log,
        rdzv_id=f"{_need(environ, 'SLURM_JOB_ID')}-{task.role}",
        nnodes=task.nodes,
        # say which node hosts the store rather than let torchrun guess it by comparing addresses
        extra=[f"--rdzv-conf=is_host={is_host}"],
    )


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, ``n[1-3,07],gpu-a1`` -> ``[n1, n2, n3, n07, gpu-a1]``."""
    hosts: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", hostlist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for n in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{n:0{len(low)}d}{suffix}")
    return hosts


def _gpu_env(task: WorkerTask, environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """A plain worker's own GPUs: its slice (by SLURM_LOCALID) of what Slurm gave the node."""
    if GPU_ENV in task.env:
        return {}
    if not task.gpus_per_worker:
        return {GPU_ENV: ""}
    node_gpus = [g for g in environ.get(GPU_ENV, "").split(",") if g]
    local = int(environ.get("SLURM_LOCALID", "0"))
    mine = node_gpus[local * task.gpus_per_worker : (local + 1) * task.gpus_per_worker]
    if len(mine) < task.gpus_per_worker:
        raise RuntimeError(
            f"{task.role}: local task {local} needs {task.gpus_per_worker} GPUs, but the node's "
            f"{GPU_ENV}={environ.get(GPU_ENV, '')!r} holds too few; check the job's --gpus-per-node"
        )
    return {GPU_ENV: ",".join(mine)}


def _redirect(log_file: Path, name: str, argv: list[str]) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    host = os.environ.get("SLURMD_NODENAME", "?")
    header = f"--- hpcrl: starting {name} on {host} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(argv)}\n"
    os.write(fd, header.encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _need(environ: dict[str, str] | os._Environ, name: str) -> str:
    value = environ.get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: a WorkerTask runs only as a task of a Slurm step (srun)")
    return value
