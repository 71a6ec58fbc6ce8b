"""What one role asks Slurm for: ``JobResources``, made from a ``RoleSpec`` and the cluster's config.

Both ways of submitting read the same options: ``per_role`` hands them to submitit's ``SlurmExecutor``
(``submitit_parameters``), ``hetjob`` writes them as ``#SBATCH`` lines of one component
(``sbatch_lines``). The srun options of a role (tasks and cores per task) come from here too, since
Slurm 22.05's srun no longer takes ``--cpus-per-task`` from the batch allocation.

    plain role:    W workers on N nodes -> W/N tasks per node, cpus_per_worker cores per task
    torchrun role: W ranks on N nodes   -> 1 task per node (torchrun), W/N * cpus_per_worker cores
    either:        W/N * gpus_per_worker GPUs per node (--gpus-per-node), only when > 0
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from hpcrl.config.schema import ClusterConfig, RoleResources
from hpcrl.launch.base import RoleSpec

# sbatch options submitit's SlurmExecutor takes as named parameters (the rest go as additional_parameters)
_SUBMITIT_NAMED = {"job_name", "partition", "time", "nodes", "ntasks_per_node", "cpus_per_task", "gpus_per_node"}
_SUBMITIT_NAMED |= {"mem", "account", "qos"}


@dataclass(frozen=True)
class JobResources:
    """One Slurm job (or hetjob component): sbatch's options for a role, in sbatch's own terms."""

    name: str  # --job-name
    nodes: int  # --nodes
    ntasks_per_node: int  # --ntasks-per-node: workers per node, or 1 torchrun per node
    cpus_per_task: int  # --cpus-per-task
    gpus_per_node: int = 0  # --gpus-per-node; 0 = ask for none
    mem_gb: float = 0.0  # --mem per node in GiB; 0 = the partition's default
    time_min: int = 60  # --time in minutes
    partition: str = ""  # --partition; "" = the site's default
    account: str = ""  # --account; "" = the user's default
    qos: str = ""  # --qos; "" = the partition's default
    constraint: str = ""  # --constraint (node features); "" = none
    extra_sbatch: tuple[str, ...] = ()  # more options, "--name=value" or "--flag"; they win over the above
    setup: tuple[str, ...] = ()  # shell lines run before this role's workers start

    def sbatch_options(self) -> dict[str, str | bool]:
        """sbatch's long options (without "--") and their values; True for a flag."""
        options: dict[str, str | bool] = {
            "job-name": self.name,
            "nodes": str(self.nodes),
            "ntasks-per-node": str(self.ntasks_per_node),
            "cpus-per-task": str(self.cpus_per_task),
            "time": str(self.time_min),
        }
        if self.gpus_per_node:
            options["gpus-per-node"] = str(self.gpus_per_node)
        if self.mem_gb:
            options["mem"] = _mem(self.mem_gb)
        for name in ("partition", "account", "qos", "constraint"):
            if getattr(self, name):
                options[name] = getattr(self, name)
        options.update(parse_extra_sbatch(self.extra_sbatch))
        return options

    def srun_args(self) -> list[str]:
        """srun's options for the role's one step: every task of the allocation, with its cores."""
        return [
            f"--nodes={self.nodes}",
            f"--ntasks={self.nodes * self.ntasks_per_node}",
            f"--ntasks-per-node={self.ntasks_per_node}",
            f"--cpus-per-task={self.cpus_per_task}",
            # one worker that exits ends the step (and so the job), instead of leaving the others running
            "--kill-on-bad-exit=1",
        ]


def role_resources(spec: RoleSpec, cluster: ClusterConfig, job_name: str) -> JobResources:
    """The Slurm resources of ``spec``'s role: the spec's counts, the role's and the cluster's settings.

    The role's settings come from ``role_settings``: defaults when the cluster names no such role.
    """
    role = role_settings(spec, cluster)
    per_node = spec.workers // spec.nodes
    tasks, cpus = (1, per_node * spec.cpus_per_worker) if spec.torchrun else (per_node, spec.cpus_per_worker)
    time_min = role.time_min or cluster.time_min
    if time_min < 2:
        # submitit's time-limit warning comes 90 s before the end: a 1-minute job gets it at once
        raise ValueError(f"{spec.role}: the Slurm time limit must be >= 2 minutes, got {time_min}")
    return JobResources(
        name=job_name,
        nodes=spec.nodes,
        ntasks_per_node=tasks,
        cpus_per_task=cpus,
        gpus_per_node=per_node * spec.gpus_per_worker,
        mem_gb=role.mem_gb,
        time_min=time_min,
        partition=role.partition or cluster.partition,
        account=own(role.account, cluster.account),
        qos=own(role.qos, cluster.qos),
        constraint=own(role.constraint, cluster.constraint),
        extra_sbatch=(*cluster.extra_sbatch, *role.extra_sbatch),  # an option the role names again: the role's
        setup=tuple(role.setup),
    )


def own(value: str | None, cluster_wide: str) -> str:
    """A role's (or the controller's) own setting, else the cluster's: None means "the cluster's", "" "none"."""
    return cluster_wide if value is None else value


def role_settings(spec: RoleSpec, cluster: ClusterConfig) -> RoleResources:
    """The role's Slurm settings: ``spec.resources`` if it is a ``RoleResources``, else ``cluster.roles``'s."""
    if isinstance(spec.resources, RoleResources):
        return spec.resources
    return cluster.roles.get(spec.role) or RoleResources()


def submitit_parameters(res: JobResources, setup: Sequence[str] = ()) -> dict:
    """``SlurmExecutor.update_parameters`` keywords for ``res``, with the job-wide ``setup`` lines first."""
    named: dict = {}
    additional: dict = {}
    for option, value in res.sbatch_options().items():
        key = option.replace("-", "_")
        if key in _SUBMITIT_NAMED:
            named[key] = int(value) if key in {"time", "nodes", "ntasks_per_node", "cpus_per_task"} else value
        else:
            additional[option] = value
    return {
        **named,
        "additional_parameters": additional,
        "setup": [*setup, *res.setup],
        "srun_args": res.srun_args(),
    }


def sbatch_lines(res: JobResources) -> list[str]:
    """``#SBATCH`` lines for ``res`` (one hetjob component), values quoted the way sbatch unquotes them."""
    return [
        f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={sbatch_quote(str(v))}"
        for k, v in res.sbatch_options().items()
    ]


def sbatch_quote(value: str) -> str:
    """``value`` as one argument of an ``#SBATCH`` line (sbatch splits those lines like a shell does)."""
    if "\n" in value:
        raise ValueError(f"an sbatch option cannot hold a newline: {value!r}")
    return shlex.quote(value)


def parse_extra_sbatch(options: Sequence[str]) -> dict[str, str | bool]:
    """``["--constraint=h100", "--exclusive"]`` -> ``{"constraint": "h100", "exclusive": True}``."""
    parsed: dict[str, str | bool] = {}
    for option in options:
        name, has_value, value = option.partition("=")
        if not name.startswith("--") or len(name) < 3 or " " in name:
            raise ValueError(
                f"extra_sbatch option {option!r} is not of the form --name=value or --flag; "
                "write sbatch's long option, e.g. --constraint=h100 instead of -C h100"
            )
        parsed[name[2:]] = value if has_value else True
    return parsed


def _mem(gb: float) -> str:
    return f"{int(gb)}G" if gb == int(gb) else f"{int(gb * 1024)}M"
