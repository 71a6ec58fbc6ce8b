"""Several roles as ONE heterogeneous Slurm job: one component per role, one batch script for all.

submitit cannot submit heterogeneous jobs, so hpcrl renders the batch script itself
(``render_hetjob_script``, also what a dry run prints and what the golden test pins) from the same
``JobResources`` that ``per_role`` hands to submitit, and keeps submitit's pickled-callable machinery:
each component's ``WorkerTask`` is a ``DelayedSubmission`` pickle in the submitit folder, which the
component's tasks load with ``python -m hpcrl.launch.slurm``::

    #SBATCH <component 0's options>            job name, nodes, tasks, cores, GPUs, time, ...
    #SBATCH --output=<folder>/%j_batch.out     the batch script's own output (component 0 runs it)
    #SBATCH hetjob
    #SBATCH <component 1's options>
    <cluster.setup>
    ( <role 0's setup>; exec srun --het-group=0 ... python -m hpcrl.launch.slurm <pickle 0> ) &
    ( <role 1's setup>; exec srun --het-group=1 ... python -m hpcrl.launch.slurm <pickle 1> ) &
    wait -n; write which component's step ended first to <folder>/<id>_ended_first; exit with its status

    output of component k: its tasks' -> <folder>/<id>+<k>_<task>_log.out|err (a plain worker writes to its
    own log instead), srun's own messages (which task failed) -> <folder>/<id>+<k>_srun.err

The roles share one fate: once the first component's step ends (a worker failed, or all of them
returned), the script exits and Slurm ends every component, so no role runs on alone, holding nodes.
Every component then ends FAILED with the script's status, whichever role failed: the script records
the component whose step ended first (``ended_first``), so that the controller names that role (the
critic's, say), not the first role it happens to check (``group.py``).

Quoting: values in ``#SBATCH`` lines and in the script are quoted with ``shlex.quote`` (sbatch splits
its lines as a shell does); ``%`` in paths that srun reads as file name patterns is doubled.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcrl.launch.slurm.resources import JobResources, sbatch_lines, sbatch_quote

SBATCH_TIMEOUT_S = 60.0  # the longest sbatch may take to answer
ENDED_FIRST = "ended_first"  # <folder>/<job id>_ended_first: the component whose step ended first


@dataclass(frozen=True)
class HetComponent:
    """One role of a heterogeneous job."""

    role: str
    resources: JobResources
    task_file: Path  # the pickled DelayedSubmission of the role's WorkerTask


def render_hetjob_script(
    components: Sequence[HetComponent], folder: Path, setup: Sequence[str] = (), python: str = sys.executable
) -> str:
    """The batch script of one heterogeneous job; ``folder`` holds its output files and task pickles."""
    if not components:
        raise ValueError("a heterogeneous job needs at least one component")
    folder = Path(folder)
    roles = ", ".join(f"{c.role} (component {k})" for k, c in enumerate(components))
    lines = ["#!/bin/bash", f"# hpcrl heterogeneous job: {roles}"]
    for k, component in enumerate(components):
        if k:
            lines.append("#SBATCH hetjob")
        lines += sbatch_lines(component.resources)
        if k == 0:  # the batch script runs in component 0; these options are the whole job's
            lines += [
                f"#SBATCH --output={sbatch_quote(_literal(folder) + '/%j_batch.out')}",
                f"#SBATCH --error={sbatch_quote(_literal(folder) + '/%j_batch.err')}",
                "#SBATCH --open-mode=append",
            ]
    lines += ["", "# setup", *setup] if setup else []
    # the folder as a path (for the shell), and as srun reads it in --output patterns
    lines += ["", f"folder={shlex.quote(str(folder))}", f"logs={shlex.quote(_literal(folder))}"]
    lines.append(f"roles=({' '.join(shlex.quote(c.role) for c in components)})")
    for k, component in enumerate(components):
        lines += ["", f"# component {k}: {component.role}", "("]
        lines += [f"  {line}" for line in component_step(k, component, python)]
        lines += [") &", f"pids[{k}]=$!"]
    lines += [
        "",
        "# the roles share one fate: when one component's step ends, the job ends and Slurm stops the others",
        "wait -n",
        "status=$?",
        "# the one that ended: its process is gone, the others run until this script exits (bash 4.3's wait -n",
        "# does not say which)",
        "first=? role=?",
        'for k in "${!pids[@]}"; do kill -0 "${pids[$k]}" 2>/dev/null || { first=$k role=${roles[$k]}; break; }; done',
        f'echo "$first" > "$folder/${{SLURM_JOB_ID}}_{ENDED_FIRST}"',
        'echo "hpcrl: the step of component $first ($role) ended first, with status $status; ending the heterogeneous '
        'job" >&2',
        "exit $status",
        "",
    ]
    return "\n".join(lines)


def ended_first(folder: Path, job_id: str) -> int | None:
    """The component of heterogeneous job ``job_id`` whose step ended first, as its batch script recorded it; None
    while it runs, or where the script could not tell."""
    try:
        text = (Path(folder) / f"{job_id}_{ENDED_FIRST}").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def component_step(k: int, component: HetComponent, python: str = sys.executable) -> list[str]:
    """Shell lines that run ``component``'s workers as one srun step of het group ``k``: its setup, then
    ``exec srun``. They expect ``$folder`` (the submitit folder) and ``$logs`` (the same, ``%`` doubled)."""
    srun = ["srun", f"--het-group={k}", "--unbuffered", *component.resources.srun_args()]
    command = [python, "-u", "-m", "hpcrl.launch.slurm", str(component.task_file)]
    output = f'"$logs/${{SLURM_JOB_ID}}+{k}_%t_log'
    own = f'2>>"$folder/${{SLURM_JOB_ID}}+{k}_srun.err"'  # srun's own messages, apart from the other roles'
    run = f'exec {shlex.join(srun)} --output {output}.out" --error {output}.err" {shlex.join(command)} {own}'
    return [*component.resources.setup, run]


def step_script(k: int, component: HetComponent, folder: Path, python: str = sys.executable) -> str:
    """``component_step`` as a script of its own (``bash -c``), for a controller inside the allocation."""
    lines = [f"folder={shlex.quote(str(folder))}", f"logs={shlex.quote(_literal(folder))}"]
    return "\n".join([*lines, *component_step(k, component, python)])


def submit_script(script: Path) -> str:
    """``sbatch SCRIPT``; the job id, or a RuntimeError with sbatch's complaint."""
    result = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True,
        text=True,
        timeout=SBATCH_TIMEOUT_S,
        check=False,
    )
    match = re.match(r"(\d+)", result.stdout.strip())
    if result.returncode != 0 or match is None:
        raise RuntimeError(
            f"sbatch {script} failed (exit {result.returncode}): {result.stderr.strip() or result.stdout.strip()}; "
            "the batch script is kept there to inspect"
        )
    return match[1]


def _literal(path: Path) -> str:
    """``path`` inside a Slurm file name pattern, where ``%`` starts a placeholder such as ``%j``."""
    return str(path).replace("%", "%%")
