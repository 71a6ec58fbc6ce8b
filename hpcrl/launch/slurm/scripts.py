"""Batch scripts a user submits by hand (``python -m hpcrl.sbatch``), from the config that ``hpcrl.main`` uses.

    controller_script   the controller as one Slurm job, the workers submitted from it (cluster.submit_mode):
                        what ``-m hydra/launcher=submitit_slurm`` submits through submitit, with the same
                        options (``controller_resources``; tests/slurm/test_sbatch.py holds the two equal)
    run_hetjob_script   the whole run as ONE heterogeneous job: component 0 the controller, 1..R the roles,
                        whose workers it starts as srun steps (cluster.submit_mode=steps, steps.py)

Both run ``python -m hpcrl.main <overrides> run.trial="slurm-$SLURM_JOB_ID" "$@"``, so ``sbatch script.sbatch
key=value ...`` adds overrides, and the run directory is named after the job unless ``run.trial`` is given
(at render or submission): a requeued job keeps its id, so it finds its directory and resumes there.
Their own output goes to ``hpcrl-<job id>.out`` in the directory sbatch ran in (Slurm makes no folders, and
the run directory does not exist before the job starts). The roles' components are rendered with the same
``role_resources`` and ``sbatch_lines`` as ``hetjob`` mode (hetjob.py). The roles come in as ``RoleSpec``s:
which roles a run has is decided above ``launch/`` (``hpcrl/controller/roles.py``, called by ``hpcrl.sbatch``).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from hpcrl.config.schema import ClusterConfig
from hpcrl.launch.base import RoleSpec
from hpcrl.launch.slurm.resources import JobResources, own, role_resources, sbatch_lines

TRIAL_KEY = "run.trial"  # the run directory's last part; the script names it after its job unless told
OUTPUT = "hpcrl-%j.out"  # the batch script's own output, in the directory sbatch ran in
OPEN_MODE = "append"  # a requeued job adds to its output rather than replacing it


def controller_resources(cluster: ClusterConfig, name: str) -> JobResources:
    """The controller's job: one task on one node, sized by ``cluster.controller``, whose partition, account,
    qos, constraint and extra sbatch options win over the cluster's (a CPU partition has no GPU features)."""
    ctl = cluster.controller
    return JobResources(
        name=name,
        nodes=1,
        ntasks_per_node=1,
        cpus_per_task=ctl.cpus,
        mem_gb=ctl.mem_gb,
        time_min=ctl.time_min or cluster.time_min,
        partition=ctl.partition or cluster.partition,
        account=own(ctl.account, cluster.account),
        qos=own(ctl.qos, cluster.qos),
        constraint=own(ctl.constraint, cluster.constraint),
        extra_sbatch=(*cluster.extra_sbatch, *ctl.extra_sbatch),
    )


def controller_script(cluster: ClusterConfig, name: str, overrides: Sequence[str], python: str) -> str:
    """The controller as one Slurm job named ``name``; it submits the workers as ``cluster.submit_mode`` says."""
    head = _header("controller", "the controller as one Slurm job; it submits its workers itself", overrides)
    lines = [*head, *sbatch_lines(controller_resources(cluster, name)), *_batch_lines(cluster)]
    return _script(lines, cluster, overrides, python)


def run_hetjob_script(
    cluster: ClusterConfig, name: str, specs: Sequence[RoleSpec], overrides: Sequence[str], python: str
) -> str:
    """The whole run as one heterogeneous job: the controller (component 0, named ``name``), then each role."""
    roles = ", ".join(f"{spec.role} ({k})" for k, spec in enumerate(specs, start=1))
    head = _header("hetjob", f"the whole run as one heterogeneous job: the controller (0), {roles}", overrides)
    lines = [*head, *sbatch_lines(controller_resources(cluster, name)), *_batch_lines(cluster)]
    for spec in specs:
        lines += ["#SBATCH hetjob", *sbatch_lines(role_resources(spec, cluster, f"{name}-{spec.role}"))]
    return _script(lines, cluster, [*overrides, "cluster.submit_mode=steps"], python)


def _batch_lines(cluster: ClusterConfig) -> list[str]:
    """The batch script's own options: its output, and USR2 to the script (exec'd into the controller) before
    the time limit, after which it checkpoints and requeues itself (hpcrl/controller/preempt.py)."""
    return [
        f"#SBATCH --output={OUTPUT}",
        f"#SBATCH --open-mode={OPEN_MODE}",
        f"#SBATCH --signal=B:USR2@{cluster.controller.signal_delay_s}",
        "#SBATCH --requeue",
    ]


def _header(kind: str, what: str, overrides: Sequence[str]) -> list[str]:
    rendered = shlex.join(["python", "-m", "hpcrl.sbatch", kind, *overrides])
    return [
        "#!/bin/bash",
        f"# hpcrl: {what}.",
        f"# Rendered by `{rendered}` (add --dry-run to print it).",
        "# Submit: sbatch THIS_FILE [key=value ...]; the overrides are added to the command at the end.",
    ]


def _script(head: list[str], cluster: ClusterConfig, overrides: Sequence[str], python: str) -> str:
    command = shlex.join([python, "-m", "hpcrl.main", *overrides])
    if not any(o.lstrip("+~").split("=", 1)[0] == TRIAL_KEY for o in overrides):
        # the job id survives a requeue: the requeued job finds its own run directory and resumes there
        command += f' {TRIAL_KEY}="slurm-$SLURM_JOB_ID"'
    command += ' "$@"'
    setup = ["", "# cluster.setup", *cluster.setup] if cluster.setup else []
    return "\n".join([*head, *setup, "", f"exec {command}", ""])


def write_script(text: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
