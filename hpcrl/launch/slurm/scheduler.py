"""``SlurmScheduler``: worker groups as Slurm jobs, one per role or one heterogeneous job for several.

    with SlurmScheduler(run_dir, slots, cluster) as scheduler:      # cluster: ClusterConfig (kind=slurm)
        servers, trainers = scheduler.start_all([server_spec, trainer_spec])  # cluster.submit_mode decides
        entries = servers.wait_ready() + trainers.wait_ready()
    # leaving the block (normally, by an exception, Ctrl-C or SIGTERM) scancels every job it submitted, by id

``start(spec)`` submits one job for one role through submitit's ``SlurmExecutor`` (folder
``<run_dir>/slurm``), or, for a spec with ``job_per_worker``, one job per worker (``<prefix><role>-<rank>``): a
``SlurmFleet`` (``fleet.py``), whose workers end, are replaced or are requeued one by one (``per_role`` mode
only). ``start_all(specs)`` does that for each spec in ``per_role`` mode, and submits one heterogeneous job
with a component per spec in ``hetjob`` mode (``hetjob.py``). Either way each task runs a pickled
``WorkerTask`` (``task.py``) that becomes the worker; workers register in the run directory's registry, which
``wait_ready`` reads.

Failures: ``check_alive`` reads the job's (or component's) state from squeue and sacct through the
scheduler's one ``JobWatcher`` (cached, every call with a timeout) and raises
``WorkerFailed(role, "job <id>", state, log tail)`` once it has ended in any way: FAILED, CANCELLED,
TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, or COMPLETED while still needed. In a heterogeneous job,
whose components end together, the group of every component raises the failure of the role whose step
ended first (the critic's ranks, say), so the run names that role whichever group it checks first. The log tail is the
failing worker's own log (the rank srun or torchrun names, else the role's newest log), then the ends of
the job's output files in the submitit folder (srun's and torchrun's messages, tracebacks of a task that
failed before it became the worker).

Cleanup: ``stop()`` scancels the group's job by id (a hetjob component's group: the whole heterogeneous
job, whose roles share one fate) and waits, up to ``stop_timeout_s``, until squeue no longer lists it.
The scheduler is a context manager that turns SIGTERM and SIGINT into exceptions while it is active
(as ``LocalScheduler`` does) and scancels every job it submitted on the way out. A job id is recorded
in the same signal-free step as its sbatch, so no job escapes between submission and bookkeeping.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import uuid
from collections.abc import Sequence

import submitit
from submitit.core.utils import DelayedSubmission

from hpcrl.config.schema import ClusterConfig
from hpcrl.errors import UserError
from hpcrl.launch.base import RoleSpec, Scheduler, WorkerFailed, WorkerGroup, worker_env
from hpcrl.launch.process import Child, ChildGroup, _signals_held, add_last_resort, remove_last_resort
from hpcrl.launch.registry import Registry
from hpcrl.launch.slots import PortSlots
from hpcrl.launch.slurm.fleet import SlurmFleet
from hpcrl.launch.slurm.group import SlurmWorkerGroup
from hpcrl.launch.slurm.hetjob import HetComponent, render_hetjob_script, step_script, submit_script
from hpcrl.launch.slurm.rendezvous import RendezvousPlan
from hpcrl.launch.slurm.resources import role_resources, role_settings, submitit_parameters
from hpcrl.launch.slurm.steps import StepWorkerGroup, check_het_allocation
from hpcrl.launch.slurm.task import WorkerTask
from hpcrl.launch.slurm.watch import JobRef, JobWatcher, cancel, wait_gone
from hpcrl.rundir import RunDir

log = logging.getLogger(__name__)

SUBMIT_MODES = ("hetjob", "per_role", "steps")


def check_slurm_commands(submit_mode: str) -> None:
    """A ``UserError`` before anything is submitted when this machine lacks a Slurm command the scheduler calls:
    sbatch (srun for the steps of ``submit_mode=steps``), squeue and scancel."""
    needed = ("srun" if submit_mode == "steps" else "sbatch", "squeue", "scancel")
    missing = [command for command in needed if shutil.which(command) is None]
    if missing:
        raise UserError(
            f"cluster.kind=slurm starts the workers as Slurm jobs, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH here: nothing was submitted",
            "run it on a login node of the cluster (python -m hpcrl.doctor checks one), or cluster=local to run on "
            "this machine",
        )


class SlurmScheduler(Scheduler):
    """Submits worker groups as Slurm jobs; ``with`` scancels every one of them (by id) on exit.

    ``slots`` numbers every listener of the run (``PortSlots``, with a rendezvous slot for each torchrun
    role, whose port is chosen on the role's first node: ``rendezvous.py``); ``net_port_range`` is the
    range they share (None: the default). ``job_prefix`` starts every job name (``<prefix><role>``); ``cache_s`` is how
    old a job state may be; ``stop_timeout_s`` how long a stop waits for squeue to drop a job.
    """

    def __init__(
        self,
        run_dir: RunDir,
        slots: PortSlots,
        cluster: ClusterConfig,
        net_port_range: tuple[int, int] | None = None,
        *,
        job_prefix: str = "hpcrl-",
        cache_s: float = 2.0,
        stop_timeout_s: float = 60.0,
    ):
        if cluster.submit_mode not in SUBMIT_MODES:
            raise ValueError(f"cluster.submit_mode must be one of {SUBMIT_MODES}, got {cluster.submit_mode!r}")
        self.run_dir = run_dir
        self.slots = slots
        self.cluster = cluster
        self.registry = Registry(run_dir.registry)
        self.net_port_range = net_port_range
        self.folder = run_dir.path / "slurm"  # submitit's folder: batch scripts, task pickles, job output
        self.job_prefix = job_prefix
        self.stop_timeout_s = stop_timeout_s
        self.watcher = JobWatcher(cache_s)
        self.job_ids: list[str] = []  # every job this scheduler submitted, in order
        self._groups: list[SlurmWorkerGroup | SlurmFleet] = []
        self._signals = ChildGroup()  # holds no children: only its SIGTERM/SIGINT-to-exception handling

    def start(self, spec: RoleSpec) -> SlurmWorkerGroup | SlurmFleet:
        """Submit ``spec``'s workers as one Slurm job of their own (through submitit), or as one job per worker
        (``spec.job_per_worker``: a ``SlurmFleet``); returns at once."""
        self._check([spec])
        if "%" in str(self.folder) or "\n" in str(self.folder):
            raise ValueError(
                f"{spec.role}: submitit writes the folder {str(self.folder)!r} into Slurm file name patterns as it "
                "is, so it must hold no '%' (a placeholder there) and no newline; choose another run.root, or "
                "submit the roles as one heterogeneous job (cluster.submit_mode=hetjob), which escapes it"
            )
        self.registry.clear(spec.role)  # entries of an earlier attempt must not count as ready
        if spec.job_per_worker:
            return self._start_fleet(spec)
        job = self._submit(spec, self._task(spec), self.job_prefix + spec.role)
        return self._group(spec, job)

    def _submit(self, spec: RoleSpec, task: WorkerTask, job_name: str) -> JobRef:
        """Submit ``task`` as one job of ``spec``'s resources through submitit; its id recorded at once."""
        resources = role_resources(spec, self.cluster, job_name)
        executor = submitit.SlurmExecutor(folder=self.folder)
        executor.update_parameters(**submitit_parameters(resources, self.cluster.setup))
        with _signals_held():  # a job whose id is not recorded could not be cancelled
            job_id = executor.submit(task).job_id
            self.job_ids.append(job_id)
        log.info("%s: submitted Slurm job %s (%s)", job_name, job_id, _describe(resources.sbatch_options()))
        return JobRef(job_id)

    def _start_fleet(self, spec: RoleSpec) -> SlurmFleet:
        """One job per worker of ``spec``: each asks for what one worker of the role needs, on one node."""
        one = dataclasses.replace(spec, workers=1, nodes=1)
        task = self._task(spec)  # the role's environment: its world size, port slots, settings

        def submit(rank: int) -> JobRef:
            job = self._submit(one, dataclasses.replace(task, rank=rank), f"{self.job_prefix}{spec.role}-{rank}")
            self.watcher.watch(job)
            return job

        args = (self.registry, submit, self.watcher, self.folder, self.run_dir, self.stop_timeout_s)
        fleet = SlurmFleet(spec, *args, self.cluster.queue_timeout_min * 60 or None)
        self._groups.append(fleet)
        fleet.start()
        return fleet

    def start_all(self, specs: Sequence[RoleSpec]) -> list[WorkerGroup]:
        """Submit every spec: one heterogeneous job (``hetjob``), or one job per spec (``per_role``).

        A single spec always gets a job of its own. The groups come back in the order of ``specs``.
        """
        specs = list(specs)
        self._check(specs)  # every spec, before any job is submitted
        if self.cluster.submit_mode == "steps":
            return list(self._start_steps(specs))
        if self.cluster.submit_mode == "per_role" or len(specs) < 2:
            return [self.start(spec) for spec in specs]
        uid = uuid.uuid4().hex[:12]
        components = self._components(specs, uid)
        script_text = render_hetjob_script(components, self.folder, self.cluster.setup)
        self.folder.mkdir(parents=True, exist_ok=True)
        for spec, component in zip(specs, components, strict=True):
            self.registry.clear(spec.role)
            DelayedSubmission(self._task(spec)).dump(component.task_file)
        script = self.folder / f".hetjob_{uid}.sh"
        script.write_text(script_text)
        with _signals_held():
            job_id = submit_script(script)
            self.job_ids.append(job_id)
        script.rename(self.folder / f"{job_id}_submission.sh")
        parts = ", ".join(f"{spec.role} {job_id}+{k}" for k, spec in enumerate(specs))
        log.info("submitted heterogeneous Slurm job %s: %s", job_id, parts)
        groups = [self._group(spec, JobRef(job_id, k)) for k, spec in enumerate(specs)]
        for group in groups:  # they end together: each names the role whose step ended first
            group.het_groups = groups
        return list(groups)

    def _start_steps(self, specs: list[RoleSpec]) -> list[SlurmWorkerGroup]:
        """Each spec as an srun step of het group 1, 2, ... of the job this controller runs in (steps.py)."""
        components = self._components(specs, uuid.uuid4().hex[:12])
        job_id = check_het_allocation(components)  # before any step starts
        return [self._start_step(job_id, k, spec) for k, spec in enumerate(specs, start=1)]

    def _start_step(self, job_id: str, k: int, spec: RoleSpec) -> SlurmWorkerGroup:
        (component,) = self._components([spec], uuid.uuid4().hex[:12])
        self.folder.mkdir(parents=True, exist_ok=True)
        self.registry.clear(spec.role)
        DelayedSubmission(self._task(spec)).dump(component.task_file)
        script = step_script(k, component, self.folder)
        srun = self._signals.spawn(f"{spec.role} step", ["bash", "-c", script], self.folder / f"{job_id}+{k}_step.log")
        log.info("%s: started as srun step of het group %d of Slurm job %s", spec.role, k, job_id)
        return self._group(spec, JobRef(job_id, k), srun)

    def restart(self, group: WorkerGroup) -> SlurmWorkerGroup | SlurmFleet:
        """Start a role whose job (or step) has ended, or whose worker the controller can no longer reach, again:
        a new job of its own (``per_role``), or a new srun step in its het group of the controller's allocation
        (``steps``). In one heterogeneous job (``hetjob``) the roles share the job's fate, so there is nothing
        left to restart into. A fleet's workers are replaced one by one: ``SlurmFleet.restart(rank)``."""
        if not isinstance(group, SlurmWorkerGroup):
            raise ValueError(f"{group.role}: one job per worker: replace the worker, with the fleet's restart(rank)")
        try:
            group.check_alive()
        except WorkerFailed:
            pass  # it has ended (or is lost), as it should have
        else:
            raise ValueError(f"{group.role}: Slurm job {group.job} is {group.state()}; only an ended one restarts")
        if self.cluster.submit_mode not in ("steps", "per_role"):
            raise ValueError(
                f"{group.role}: cluster.submit_mode=hetjob: its job ended with the whole heterogeneous job; "
                "restart needs cluster.submit_mode=per_role or steps"
            )
        group.stop()  # one the controller could no longer reach may still run: it goes, by id (or PID) as always
        if self.cluster.submit_mode == "steps":
            assert group.job.component is not None, "a step group runs in a het group"
            return self._start_step(group.job.job_id, group.job.component, group.spec)
        return self.start(group.spec)

    def hetjob_script(self, specs: Sequence[RoleSpec]) -> str:
        """The batch script ``start_all(specs)`` would submit as one heterogeneous job (for dry runs)."""
        specs = list(specs)
        self._check(specs)
        return render_hetjob_script(self._components(specs, "<uid>"), self.folder, self.cluster.setup)

    def close(self) -> None:
        """scancel every job this scheduler submitted (by id) and wait until squeue drops them."""
        with _signals_held():  # a signal waits until this is done (a second one ends at once: _last_resort)
            for group in self._groups:  # steps of the controller's own job end with self._signals, by PID
                group._stopped = True
            cancel(self.job_ids)
            left = wait_gone(self.job_ids, self.stop_timeout_s)
            if left:
                log.error("Slurm jobs %s are still listed by squeue %g s after scancel", left, self.stop_timeout_s)

    def __enter__(self) -> SlurmScheduler:
        check_slurm_commands(self.cluster.submit_mode)  # a run's scheduler; one made to render scripts needs none
        self._signals.__enter__()  # from here SIGTERM and SIGINT unwind through __exit__
        add_last_resort(self._last_resort)  # and when the process must end at once, the jobs still go
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            remove_last_resort(self._last_resort)
            self._signals.__exit__(*exc)

    def _last_resort(self) -> None:
        cancel(self.job_ids)

    def _check(self, specs: list[RoleSpec]) -> None:
        roles = [spec.role for spec in specs]
        if len(set(roles)) != len(roles):
            raise ValueError(f"each role may be started once per call, got {roles}")
        for spec in specs:
            if spec.job_per_worker and self.cluster.submit_mode != "per_role":
                raise ValueError(
                    f"{spec.role}: one Slurm job per worker (job_per_worker) needs cluster.submit_mode=per_role, "
                    f"got {self.cluster.submit_mode}: a heterogeneous job or its steps hold all of a role's workers"
                )
            self.slots.base(spec.role)  # a role without slots is the clearer error
            if self.slots.counts[spec.role] != spec.workers:
                raise ValueError(
                    f"{spec.role}: the spec has {spec.workers} workers but the run's PortSlots counts "
                    f"{self.slots.counts[spec.role]}; build PortSlots from the same allocation as the specs"
                )
            role_resources(spec, self.cluster, spec.role)  # bad resources fail before anything is submitted

    def _components(self, specs: list[RoleSpec], uid: str) -> list[HetComponent]:
        return [
            HetComponent(
                spec.role,
                role_resources(spec, self.cluster, self.job_prefix + spec.role),
                self.folder / f"{uid}_{spec.role}_task.pkl",
            )
            for spec in specs
        ]

    def _task(self, spec: RoleSpec) -> WorkerTask:
        settings = role_settings(spec, self.cluster)
        env = {**self.cluster.env, **settings.env, **worker_env(self.run_dir.path, spec, self.slots)}
        return WorkerTask(
            role=spec.role,
            argv=list(spec.argv),
            env=env,
            logs=self.run_dir.logs,
            workers=spec.workers,
            nodes=spec.nodes,
            gpus_per_worker=spec.gpus_per_worker,
            torchrun=spec.torchrun,
            rendezvous=self._rendezvous(spec) if spec.torchrun else None,
        )

    def _rendezvous(self, spec: RoleSpec) -> RendezvousPlan:
        """A torchrun role's rendezvous: its port is chosen on the first node of its step, from its own slot."""
        return RendezvousPlan(
            slot=self.slots.rendezvous(spec.role),
            world=self.slots.world,
            port_range=self.net_port_range,
            file=self.registry.directory / f"{spec.role}.rendezvous.json",
            timeout_s=spec.setup_timeout_s,
        )

    def _group(self, spec: RoleSpec, job: JobRef, srun: Child | None = None) -> SlurmWorkerGroup:
        """The one place a group is made: a job's (or het component's), or an srun step's when ``srun`` is given."""
        args = (spec, self.registry, job, self.watcher, self.folder, self.run_dir, self.stop_timeout_s)
        if srun is not None:  # a step of the controller's own job: its srun's exit says it has ended
            group: SlurmWorkerGroup = StepWorkerGroup(*args, srun=srun)
        else:
            self.watcher.watch(job)
            group = SlurmWorkerGroup(*args, self.cluster.queue_timeout_min * 60 or None)
        self._groups.append(group)
        return group


def _describe(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items() if k != "job-name")
