"""The workers of a run as launch ``RoleSpec``s: what each role runs, how many, where, with what resources.

    server    python -m hpcrl.inference.worker       one per inference server
    trainer   torchrun -> python -m hpcrl.train.worker   one rank per trainer worker, one torchrun per node
    critic    torchrun -> python -m hpcrl.train.worker --role critic   only with allocation.critic.workers > 0
    rollout   python -m hpcrl.rollout.episode_worker  only with rollout.workers > 0
    reward_model  python -m hpcrl.inference.worker --role reward_model   only with allocation.reward_model.workers > 0

The one place that turns the config's allocation into processes, for the job (``controller/job.py``), the
batch scripts (``hpcrl/sbatch.py``) and the doctor alike; ``launch/`` takes the specs and knows no role.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from hpcrl.config.schema import Config, RoleAllocation, RoleResources
from hpcrl.cores import usable_cores
from hpcrl.launch.base import RoleSpec


def role_specs(cfg: Config) -> list[RoleSpec]:
    """Every role the run starts, in the order the scheduler starts them: servers, trainers, the critic,
    rollout workers, the reward model's servers."""
    return [server_spec(cfg), trainer_spec(cfg), *critic_specs(cfg), *rollout_specs(cfg), *reward_model_specs(cfg)]


def server_spec(cfg: Config) -> RoleSpec:
    """The servers; an elastic fleet (``allocation.server.min_workers``) has each of them as a Slurm job of its own."""
    spec = _role_spec(cfg, "server", "hpcrl.inference.worker")
    return replace(spec, job_per_worker=cfg.allocation.server.min_workers is not None)


def trainer_spec(cfg: Config) -> RoleSpec:
    return _role_spec(cfg, "trainer", "hpcrl.train.worker", torchrun=True, env=rank_env(cfg, "trainer"))


def critic_specs(cfg: Config) -> list[RoleSpec]:
    """The critic's role, when ``allocation.critic.workers`` > 0 (``algorithm.advantage=gae``): FSDP ranks under
    torchrun like the trainer's, running the value model. Its resources: ``cluster.roles.critic``, else the
    trainer's."""
    if not cfg.allocation.critic.workers:
        return []
    env = rank_env(cfg, "critic")
    return [_role_spec(cfg, "critic", "hpcrl.train.worker", torchrun=True, env=env, args=["--role", "critic"])]


def rank_env(cfg: Config, role: str) -> dict[str, str]:
    """The threading environment of each trainer or critic rank: ``OMP_NUM_THREADS`` (``rank_threads``) and, on a
    local cluster, ``OMP_WAIT_POLICY=PASSIVE``. There the ranks share the cores with the servers, the controller and
    whatever else the machine runs, and an OpenMP thread that spins at a barrier while its core is taken only burns
    it: the default job took 106 CPU-s with spinning threads and 58 with passive ones beside another engineer's
    work, and two concurrent REINFORCE++ jobs 80 and 26 each (``tests/conftest.py``). An ``OMP_WAIT_POLICY`` in this
    process's environment, ``cluster.env`` or the role's ``env`` wins."""
    env = {"OMP_NUM_THREADS": str(rank_threads(cfg, role))}
    if cfg.cluster.kind == "local" and "OMP_WAIT_POLICY" not in os.environ:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def rank_threads(cfg: Config, role: str) -> int:
    """Torch threads (``OMP_NUM_THREADS``) of each trainer or critic rank. On Slurm: the role's
    ``cpus_per_worker``, the cores its job asks for each rank. On a local cluster: this machine's cores shared
    among the run's trainer and critic ranks, which update at the same time (one CPU rank of the default job gets
    both cores of a 2-core machine; a thread beyond the free cores only spin-waits). ``OMP_NUM_THREADS`` in
    ``cluster.env`` or the role's ``env`` wins over both."""
    if cfg.cluster.kind != "local":
        return _resources(cfg, role).cpus_per_worker
    ranks = cfg.allocation.trainer.workers + cfg.allocation.critic.workers
    return max(1, usable_cores() // max(1, ranks))


def rollout_specs(cfg: Config) -> list[RoleSpec]:
    """The rollout workers' role, when ``rollout.workers`` > 0: episodes (workflow and reward) run there.

    They wait for the servers themselves, so they start with them; each runs ``reward.workers`` reward
    processes, so on Slurm give the role that many CPUs and one more (``cluster.roles.rollout``).
    """
    if not cfg.rollout.workers:
        return []
    return [_role_spec(cfg, "rollout", "hpcrl.rollout.episode_worker", env={"OMP_NUM_THREADS": "1"})]


def reward_model_specs(cfg: Config) -> list[RoleSpec]:
    """The reward model's servers, when ``allocation.reward_model.workers`` > 0: the servers' worker serving
    ``reward.model.path``, whose weights never change. Its resources: ``cluster.roles.reward_model``, else the
    servers'."""
    if not cfg.allocation.reward_model.workers:
        return []
    return [_role_spec(cfg, "reward_model", "hpcrl.inference.worker", args=["--role", "reward_model"])]


def _role_spec(
    cfg: Config, role: str, module: str, torchrun: bool = False, env: dict | None = None, args: list[str] | None = None
) -> RoleSpec:
    res = _resources(cfg, role)
    alloc = getattr(cfg.allocation, role, None) or RoleAllocation(
        "cpu", cfg.rollout.workers, gpus_per_worker=0, nodes=1
    )
    return RoleSpec(
        role,
        [sys.executable, "-m", module, *(args or [])],
        workers=alloc.workers,
        nodes=alloc.nodes,
        gpus_per_worker=alloc.gpus_per_worker or 0,
        cpus_per_worker=res.cpus_per_worker,
        torchrun=torchrun,
        env={**(env or {}), **cfg.cluster.env, **res.env},
        setup_timeout_s=res.setup_timeout_s,
        resources=res,  # Slurm's settings (partition, time, sbatch lines, ...): the critic's may be the trainer's
    )


def _resources(cfg: Config, role: str) -> RoleResources:
    return cfg.cluster.roles.get(role) or _default_resources(cfg, role)


def _default_resources(cfg: Config, role: str) -> RoleResources:
    """A role the cluster names no resources for. The critic: the trainer's (the same kind of ranks). The reward
    model: the servers' (the same kind of worker). Rollout: a CPU per reward process and one more, and the servers'
    setup timeout, since rollout workers wait for them."""
    if role == "critic" and "trainer" in cfg.cluster.roles:
        return cfg.cluster.roles["trainer"]
    if role == "reward_model" and "server" in cfg.cluster.roles:
        return cfg.cluster.roles["server"]
    server = cfg.cluster.roles.get("server") or RoleResources()
    return RoleResources(setup_timeout_s=server.setup_timeout_s, cpus_per_worker=cfg.reward.workers + 1)
