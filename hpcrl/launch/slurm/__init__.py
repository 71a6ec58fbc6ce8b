"""The ``slurm`` scheduler: worker groups as Slurm jobs, beside ``local`` behind the same seam (``base.py``).

controller (SlurmScheduler)            squeue / sacct (JobWatcher, cached)   scancel <id> on every exit
    | per_role: submitit SlurmExecutor, one job per role (or per worker: job_per_worker, a fleet)
    | hetjob:   one heterogeneous job, a component per role (render_hetjob_script)
    v
job <id> | component <id>+k            one srun step per role
    task 0 .. T-1                      a pickled WorkerTask that execs the worker (plain: one task per
                                       worker; torchrun: one torchrun per node) -> logs/<role>-<rank>.log
                                       workers register host:port in <run_dir>/registry

resources.py   RoleSpec + ClusterConfig -> JobResources (sbatch and srun options), for both modes
task.py        WorkerTask: what each Slurm task runs (rank, GPUs, log file, torchrun command)
hetjob.py      render_hetjob_script: the batch script of one heterogeneous job; sbatch
watch.py       JobWatcher: job states from squeue and sacct; cancel and wait_gone, by job id
scheduler.py   SlurmScheduler: submits the groups, restarts a role, scancels every job on exit
group.py       SlurmWorkerGroup: one role's job (or het component); steps.py: the same as an srun step
fleet.py       SlurmFleet: one job per worker of a role; a rank ends, is replaced or is requeued alone
"""

from hpcrl.launch.slurm.fleet import SlurmFleet
from hpcrl.launch.slurm.group import SlurmWorkerGroup
from hpcrl.launch.slurm.hetjob import HetComponent, render_hetjob_script
from hpcrl.launch.slurm.resources import JobResources, role_resources
from hpcrl.launch.slurm.scheduler import SlurmScheduler
from hpcrl.launch.slurm.task import WorkerTask

__all__ = [
    "HetComponent",
    "JobResources",
    "SlurmFleet",
    "SlurmScheduler",
    "SlurmWorkerGroup",
    "WorkerTask",
    "render_hetjob_script",
    "role_resources",
]
