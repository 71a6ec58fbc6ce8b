"""The doctor's tiny Slurm jobs: a script per probe, submitted, waited for with a deadline, cancelled by id.

    probe_script(resources, output, body, setup, env)   #SBATCH lines (resources.py's sbatch_lines), the
                                                        cluster's setup lines and env, then the probe's body
    with ProbeJobs(folder) as jobs:
        job_id = jobs.submit("network", script)         # the id is recorded in the same signal-free step
        state = jobs.wait(job_id, deadline)             # a final state, or the state at the deadline
    # leaving the block scancels every job it submitted, by id, and waits until squeue drops them

Every call to Slurm has a timeout (``watch.py``, ``hetjob.submit_script``); every wait has a deadline.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcrl.launch.process import _signals_held, read_tail
from hpcrl.launch.slurm.hetjob import submit_script
from hpcrl.launch.slurm.resources import JobResources, sbatch_lines, sbatch_quote
from hpcrl.launch.slurm.watch import JobRef, JobState, JobWatcher, cancel, wait_gone

POLL_S = 0.5  # how often a wait asks Slurm (through the watcher's cache) for a job's state
STOP_TIMEOUT_S = 30.0  # how long the exit waits for squeue to drop the cancelled jobs
OUTPUT_LINES = 15  # lines of a probe job's output quoted in a failure


def probe_script(
    resources: JobResources,
    output: Path,
    body: Sequence[str],
    setup: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> str:
    """A batch script: ``resources`` as #SBATCH lines, stdout and stderr to ``output``, then setup, env, body."""
    exports = [f"export {name}={shlex.quote(value)}" for name, value in (env or {}).items()]
    return "\n".join(
        [
            "#!/bin/bash",
            "# hpcrl doctor: a probe job (python -m hpcrl.doctor)",
            *sbatch_lines(resources),
            f"#SBATCH --output={sbatch_quote(str(output).replace('%', '%%'))}",
            *setup,
            *exports,
            *body,
            "",
        ]
    )


def output_tail(path: Path) -> str:
    """The end of a probe job's output file, or a note that there is none here."""
    tail = read_tail(path, OUTPUT_LINES).strip() if path.exists() else ""
    return tail or f"<no output in {path}>"


class ProbeJobs:
    """The probe jobs of one doctor run; ``with`` scancels every one of them (by id) on exit."""

    def __init__(self, folder: Path):
        self.folder = folder  # scripts and outputs of the probe jobs
        self.job_ids: list[str] = []
        self.watcher = JobWatcher(cache_s=POLL_S)

    def submit(self, name: str, script: str) -> str:
        """Submit ``script`` (written to ``<folder>/<name>.sbatch``); its job id, or RuntimeError from sbatch."""
        path = self.folder / f"{name}.sbatch"
        path.write_text(script)
        with _signals_held():  # a job whose id is not recorded could not be cancelled
            job_id = submit_script(path)
            self.job_ids.append(job_id)
        return job_id

    def state(self, job_id: str) -> JobState:
        return self.watcher.state(JobRef(job_id))

    def wait(self, job_id: str, deadline: float) -> JobState:
        """Poll until the job has ended or the deadline (time.monotonic) has passed; its state then."""
        while True:
            state = self.state(job_id)
            if state.final or time.monotonic() >= deadline:
                return state
            time.sleep(POLL_S)

    def __enter__(self) -> ProbeJobs:
        return self

    def __exit__(self, *exc: object) -> None:
        with _signals_held():  # a second Ctrl-C must not leave a job behind
            cancel(self.job_ids)
            wait_gone(self.job_ids, STOP_TIMEOUT_S)
