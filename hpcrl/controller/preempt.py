"""Preemption and time limits: Slurm's warning signal becomes a checkpoint at the next step boundary, then
the controller job requeues itself and the requeued job resumes from that checkpoint.

    Slurm: USR2 some seconds before the time limit (--signal), or when the job is preempted
      -> PreemptionGuard notes it (the handler only sets a flag: no work inside a signal handler)
      -> the loop ends the step it is in, writes a checkpoint, raises Preempted
      -> leaving the scheduler's block ends every worker (their jobs are cancelled by id)
      -> requeue(): under submitit (the Hydra launcher) submitit's own handler requeues the job;
         from a hand-submitted script, `scontrol requeue $SLURM_JOB_ID`
      -> the requeued job (SLURM_RESTART_COUNT > 0) runs with recover.mode=auto and goes on

Outside a Slurm job the signal is only logged, and the run goes on.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import Any

log = logging.getLogger(__name__)

PREEMPT_SIGNAL = signal.SIGUSR2  # what submitit asks Slurm for (--signal=USR2@<delay>), and the scripts too
REQUEUE_TIMEOUT_S = 60.0


class Preempted(Exception):
    """The run stopped at a step boundary for a preemption or time-limit signal, after a checkpoint."""

    def __init__(self, step: int, checkpoint: str):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"preempted after step {step}; checkpoint {checkpoint}")


def restarted_by_slurm(env: dict[str, str] | None = None) -> bool:
    """True in a Slurm job that was requeued (it runs again from the start of its script)."""
    env = os.environ if env is None else env
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0) > 0


class PreemptionGuard:
    """While active, ``requested`` turns True when the preemption signal arrives."""

    def __init__(self, signum: int = PREEMPT_SIGNAL):
        self.signum = signum
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> PreemptionGuard:
        self._previous = signal.signal(self.signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.signum, self._previous)

    def _note(self, signum: int, frame: object) -> None:
        self.requested = True
        # logging from a signal handler can deadlock on the handler's lock; a plain write cannot
        os.write(2, f"hpcrl: got {signal.Signals(signum).name}: checkpointing after this step, then requeue\n".encode())

    def requeue(self) -> None:
        """Requeue this Slurm job and exit; outside Slurm, only say so. Called after the checkpoint."""
        if callable(self._previous):  # submitit's handler: it re-pickles the job, requeues, and exits
            self._previous(self.signum, None)
            return
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            log.warning("preempted outside a Slurm job: nothing to requeue; rerun with recover.mode=auto")
            return
        result = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"scontrol requeue {job_id} failed: {result.stderr.strip()}; resume by hand")
        log.info("requeued Slurm job %s; it resumes from the last checkpoint", job_id)
        sys.exit(0)
