"""``submit_mode=steps``: the controller already runs inside a heterogeneous job whose component 0 is its
own and whose components 1..R are the roles' (a script from ``python -m hpcrl.sbatch hetjob``, submitted
by hand); it starts each role as an srun step of its het group instead of submitting jobs.

    sbatch hetjob.sbatch  ->  component 0: python -m hpcrl.main ... cluster.submit_mode=steps
                                  srun --het-group=1 ... server workers   (a child process, by PID)
                                  srun --het-group=2 ... trainer ranks

Before any step starts, the allocation Slurm gave (``SLURM_HET_SIZE``, ``SLURM_JOB_NUM_NODES_HET_GROUP_k``,
``SLURM_NTASKS_HET_GROUP_k``) is checked against what the config asks of each role, so a script rendered
for another allocation fails with a message naming the role and both shapes. A step whose srun ends fails
its group; stopping a group ends its srun (SIGTERM, then SIGKILL, by PID), which ends the step's tasks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from hpcrl.launch.base import WorkerFailed
from hpcrl.launch.process import Child
from hpcrl.launch.slurm.group import SlurmWorkerGroup
from hpcrl.launch.slurm.hetjob import HetComponent
from hpcrl.launch.slurm.watch import JobState


class AllocationMismatch(RuntimeError):
    """The heterogeneous job the controller runs in does not have the components the config asks for."""


def check_het_allocation(components: Sequence[HetComponent], env: Mapping[str, str] = os.environ) -> str:
    """The het job's id, once its components 1..R match ``components`` (nodes and tasks); else a clear error."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise AllocationMismatch(
            "cluster.submit_mode=steps runs the roles as steps of the Slurm job the controller runs in, but "
            "SLURM_JOB_ID is not set: submit the script `python -m hpcrl.sbatch hetjob ...` prints, or use "
            "cluster.submit_mode=hetjob|per_role"
        )
    size = int(env.get("SLURM_HET_SIZE", "1"))
    if size != len(components) + 1:
        roles = ", ".join(c.role for c in components)
        raise AllocationMismatch(
            f"Slurm job {job_id} has {size} het components; cluster.submit_mode=steps needs {len(components) + 1}: "
            f"the controller's (0) and one for each role ({roles}); render the script for this config"
        )
    for k, component in enumerate(components, start=1):
        want = (component.resources.nodes, component.resources.nodes * component.resources.ntasks_per_node)
        have = (int(env.get(f"SLURM_JOB_NUM_NODES_HET_GROUP_{k}", -1)), int(env.get(f"SLURM_NTASKS_HET_GROUP_{k}", -1)))
        if want != have:
            raise AllocationMismatch(
                f"{component.role}: het component {k} of Slurm job {job_id} has {have[0]} nodes and {have[1]} "
                f"tasks; the config asks for {want[0]} nodes and {want[1]} tasks; render the script for this config"
            )
    return job_id


class StepWorkerGroup(SlurmWorkerGroup):
    """The workers of one role as an srun step of the controller's own heterogeneous job."""

    def __init__(self, *args, srun: Child, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.srun = srun

    def state(self) -> JobState:
        code = self.srun.poll()
        return JobState("RUNNING") if code is None else JobState("STEP ENDED", exit_code=f"{code}")

    def check_alive(self) -> None:
        if self.srun.poll() is not None:
            state = self.state()
            tail, log_file = self._failure_report(state)
            tail = f"{tail}\n--- srun:\n{self.srun.log_tail(10)}"
            raise WorkerFailed(
                self.role, f"step of het group {self.job.component} (job {self.job})", state.state, tail, log_file
            )
        self._check_lost(f"step of het group {self.job.component} (job {self.job})")

    def stop(self) -> None:
        """End the step's srun (by PID): srun passes the signal on to every task of the step."""
        if not self._stopped:
            self._stopped = True
            self.srun.stop(grace_s=self.stop_timeout_s)
