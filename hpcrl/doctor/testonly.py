"""``sbatch --test-only`` of every job a run submits, rendered by the code that submits them.

    sbatch <role>        each role's job alone (role_resources -> sbatch_lines): partition, account, qos,
                         nodes, GPUs, time, extra sbatch options; the per_role jobs, and what names a culprit
    sbatch hetjob        cluster.submit_mode=hetjob: the roles as one heterogeneous job (render_hetjob_script)
    sbatch controller    the controller's job (controller_resources), what -m hydra/launcher=submitit_slurm
                         and ``python -m hpcrl.sbatch controller`` submit
    sbatch run hetjob    cluster.submit_mode=steps: the whole run as one hetjob (``python -m hpcrl.sbatch hetjob``)

sbatch validates a script against slurmctld (partition, account and qos associations, node counts, GRES)
and says when the job would start; nothing is queued. A start more than ``LATE_S`` away is a warning.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from hpcrl.config.schema import Config
from hpcrl.doctor.report import Result, fail, ok, warn
from hpcrl.launch.slurm.hetjob import SBATCH_TIMEOUT_S, HetComponent, render_hetjob_script
from hpcrl.launch.slurm.resources import JobResources, role_resources, sbatch_lines
from hpcrl.launch.slurm.scripts import controller_resources, run_hetjob_script

LATE_S = 3600.0  # a job Slurm would start later than this waits behind others: say so
ADVICE = (
    "fix the partition, account, qos, GPUs or time in your site file, DIR/cluster/<site>.yaml of --config-dir DIR "
    "(sinfo -s lists partitions; sacctmgr show assoc user=$USER your accounts and QOS)"
)
_START = re.compile(r"start at (\S+)")
_JOB_ID = re.compile(r"Job \d+ to start at ")


def sbatch_checks(cfg: Config, job_prefix: str, python: str, folder: Path) -> Iterator[Result]:
    """``folder`` only names output files in the rendered scripts; --test-only writes nothing there."""
    from hpcrl.controller.roles import role_specs

    specs = role_specs(cfg)
    components = []
    for spec in specs:
        try:
            res = role_resources(spec, cfg.cluster, job_prefix + spec.role)
        except ValueError as e:  # a time limit Slurm jobs of hpcrl cannot have
            yield fail(f"sbatch {spec.role}", str(e), "raise cluster.time_min or the role's time_min")
            continue
        components.append(HetComponent(spec.role, res, folder / f"{spec.role}.pkl"))
        yield sbatch_test_only(f"sbatch {spec.role}", job_script(res, cfg.cluster.setup))
    if cfg.cluster.submit_mode == "hetjob" and len(components) == len(specs) > 1:
        script = render_hetjob_script(components, folder, cfg.cluster.setup, python)
        parts = [c.resources for c in components]
        yield hetjob_fits("sbatch hetjob", parts) or sbatch_test_only("sbatch hetjob", script)
    controller = controller_resources(cfg.cluster, job_prefix + "controller")
    yield sbatch_test_only("sbatch controller", job_script(controller, cfg.cluster.setup))
    if cfg.cluster.submit_mode == "steps" and len(components) == len(specs):
        parts = [controller, *(c.resources for c in components)]
        script = run_hetjob_script(cfg.cluster, f"hpcrl-{cfg.run.experiment}", specs, [], python)
        yield hetjob_fits("sbatch run hetjob", parts) or sbatch_test_only("sbatch run hetjob", script)


def job_script(res: JobResources, setup: list[str]) -> str:
    return "\n".join(["#!/bin/bash", *sbatch_lines(res), *setup, "true", ""])


def sbatch_test_only(check: str, script: str) -> Result:
    """sbatch --test-only with the script on stdin; sbatch's answer as the result."""
    try:
        result = subprocess.run(
            ["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return fail(check, f"sbatch did not answer within {SBATCH_TIMEOUT_S:g} s", "is slurmctld up? scontrol ping")
    except OSError as e:
        return fail(check, f"cannot run sbatch: {e}", "run the doctor where Slurm's commands are (a login node)")
    said = "; ".join(line.removeprefix("sbatch: ") for line in (result.stderr + result.stdout).strip().splitlines())
    if result.returncode != 0:
        return fail(check, f"sbatch refuses it: {said}", ADVICE)
    said = _JOB_ID.sub("it would start at ", said)  # --test-only's job id names no job
    start = _start_time(said)
    if start is not None and (start - datetime.now()).total_seconds() > LATE_S:
        return warn(check, f"sbatch accepts it: {said}", "it queues behind others: a smaller allocation starts sooner")
    return ok(check, f"sbatch accepts it: {said}")


def hetjob_fits(check: str, parts: list[JobResources]) -> Result | None:
    """A fail when a partition has fewer nodes than the hetjob's components ask for together (Slurm never puts
    two components on one node, and --test-only does not check that); None when they fit or sinfo cannot say."""
    default, sizes = partition_sizes()
    wanted: Counter[str] = Counter()
    for res in parts:
        wanted[res.partition or default] += res.nodes
    for partition, nodes in wanted.items():
        have = sizes.get(partition, 0)
        if have and nodes > have:
            found = f"its {len(parts)} components need {nodes} nodes of partition {partition}, which has {have}"
            advice = "Slurm never puts two components on one node: fewer nodes per role, or submit_mode=per_role"
            return fail(check, found, advice)
    return None


def partition_sizes() -> tuple[str, dict[str, int]]:
    """The default partition and the nodes of every partition, from sinfo; ("", {}) when sinfo cannot say."""
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-o", "%P %D"], capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "", {}
    default, sizes = "", {}
    for line in result.stdout.splitlines():
        name, _, nodes = line.partition(" ")
        if nodes.strip().isdigit():
            sizes[name.rstrip("*")] = int(nodes)
            default = name.rstrip("*") if name.endswith("*") else default
    return default, sizes


def _start_time(said: str) -> datetime | None:
    match = _START.search(said)
    if match is None:
        return None
    try:
        return datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None
