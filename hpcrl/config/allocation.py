"""The allocation resolved and checked against the cluster (``checks.validate`` calls it): the shorthand applied,
each role's backend, GPUs per worker and node count filled in, and what a node holds kept within its GPUs and cores.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hpcrl.config.errors import ConfigError, one_of, require
from hpcrl.config.schema import AllocationConfig, ClusterConfig, RoleAllocation, RoleResources
from hpcrl.config.shorthand import SERVER_BACKENDS, TRAINER_BACKENDS, parse_spec

ROLES = ("server", "trainer")  # the roles every run has; the critic's (advantage=gae) and rollout's are optional


def resolve_allocation(a: AllocationConfig, cluster: ClusterConfig) -> AllocationConfig:
    """Apply the shorthand, fill backend defaults and node counts, and check that roles fit the cluster."""
    roles = parse_spec(a.spec) if a.spec else {"server": a.server, "trainer": a.trainer, "critic": a.critic}
    if not a.spec:
        roles["reward_model"] = a.reward_model
    resolved = {role: _resolve_role(f"allocation.{role}", role, roles[role], cluster) for role in ROLES}
    critic = roles.get("critic") or replace(a.critic, workers=0)  # a shorthand without one: no critic
    require(critic.workers >= 0, "allocation.critic.workers", critic.workers, "an integer >= 0 (0 = no critic)")
    if critic.workers:
        if critic.gpus_per_worker is None:  # the critic's ranks are where the trainer's are: GPUs, or CPUs
            critic = replace(critic, gpus_per_worker=resolved["trainer"].gpus_per_worker)
        resolved["critic"] = _resolve_role("allocation.critic", "critic", critic, cluster)
    else:
        resolved["critic"] = critic
    resolved["reward_model"] = _resolve_reward_model(roles.get("reward_model"), a.reward_model, cluster)
    return replace(a, **resolved)


def _resolve_reward_model(
    given: RoleAllocation | None, schema: RoleAllocation, cluster: ClusterConfig
) -> RoleAllocation:
    """The reward model's servers (``allocation.reward_model``): resolved like the servers' when it has workers; a
    shorthand without ``rm:`` has none."""
    rm = given or replace(schema, workers=0)
    where = "allocation.reward_model"
    require(rm.workers >= 0, f"{where}.workers", rm.workers, "an integer >= 0 (0 = no reward model)")
    require(rm.min_workers is None, f"{where}.min_workers", rm.min_workers, "null (only the servers are elastic)")
    return _resolve_role(where, "reward_model", rm, cluster) if rm.workers else rm


def _resolve_role(where: str, role: str, r: RoleAllocation, cluster: ClusterConfig) -> RoleAllocation:
    # the critic's ranks are the trainer's kind (FSDP2 under torchrun), so its backends are the trainer's
    serves = role in ("server", "reward_model")  # the reward model's are inference servers too
    one_of(f"{where}.backend", r.backend, SERVER_BACKENDS if serves else TRAINER_BACKENDS)
    require(r.workers >= 1, f"{where}.workers", r.workers, "an integer >= 1")
    require(r.tp_size >= 1, f"{where}.tp_size", r.tp_size, "an integer >= 1")
    require(r.tp_size == 1 or serves, f"{where}.tp_size", r.tp_size, "1 (tensor parallelism is a server's)")
    gpus = _default_gpus(r) if r.gpus_per_worker is None else r.gpus_per_worker
    _check_gpus(where, r, gpus)
    if gpus > cluster.gpus_per_node:
        expected = f"at most cluster.gpus_per_node={cluster.gpus_per_node} ({cluster.name} nodes have that many)"
        if cluster.kind == "local":  # the one-GPU-machine case: say what makes it work
            expected += "; on one GPU machine without Slurm use cluster=local_gpu (or set cluster.gpus_per_node=N)"
        raise ConfigError(f"{where}.gpus_per_worker", gpus, expected)
    nodes = r.nodes or _fewest_nodes(r.workers, gpus, cluster.gpus_per_node)
    require(nodes >= 1, f"{where}.nodes", r.nodes, "an integer >= 0 (0 = the fewest that fit)")
    per_node = r.workers // nodes
    require(r.workers % nodes == 0, f"{where}.nodes", nodes, f"a divisor of workers={r.workers}")
    fits = per_node * gpus <= cluster.gpus_per_node
    require(fits, f"{where}.nodes", nodes, f"enough nodes for {r.workers}x{gpus} GPUs at {cluster.gpus_per_node}/node")
    require(cluster.kind != "local" or nodes == 1, f"{where}.nodes", nodes, "1 on cluster.kind=local")
    return replace(r, gpus_per_worker=gpus, nodes=nodes)


def check_cpus_per_node(cluster: ClusterConfig, allocation: AllocationConfig) -> None:
    """On Slurm, the cores a role asks of one node (its workers there, each ``cpus_per_worker``) fit in
    ``cluster.cpus_per_node`` (0: not checked)."""
    if cluster.kind != "slurm" or not cluster.cpus_per_node:
        return
    for role, r in allocation.roles().items():
        per_node, cpus = r.workers // r.nodes, _role_resources(cluster, role).cpus_per_worker
        if per_node * cpus > cluster.cpus_per_node:
            expected = (
                f"at most {cluster.cpus_per_node // per_node}: {per_node} {role} workers share a node of "
                f"cluster.cpus_per_node={cluster.cpus_per_node} cores (or spread them: allocation.{role}.nodes)"
            )
            raise ConfigError(f"cluster.roles.{role}.cpus_per_worker", cpus, expected)


def _role_resources(cluster: ClusterConfig, role: str) -> RoleResources:
    """``cluster.roles``' resources of a role; the reward model's default to the servers' (controller/roles.py)."""
    if role == "reward_model" and role not in cluster.roles:
        role = "server"
    return cluster.roles.get(role) or RoleResources()


def _default_gpus(r: RoleAllocation) -> int:
    return {"sglang": r.tp_size, "fsdp": 1}.get(r.backend, 0)


def _check_gpus(where: str, r: RoleAllocation, gpus: int) -> None:
    path = f"{where}.gpus_per_worker"
    if r.backend == "sglang":
        require(gpus == r.tp_size, path, gpus, f"tp_size={r.tp_size} (one GPU per tensor-parallel rank)")
    elif r.backend == "cpu":
        require(gpus == 0, path, gpus, "0 (the cpu server uses no GPU)")
    else:
        require(gpus in (0, 1), path, gpus, "1 (one GPU per FSDP rank) or 0 (CPU ranks over gloo)")


def _fewest_nodes(workers: int, gpus: int, gpus_per_node: int) -> int:
    if gpus == 0:
        return 1
    return math.ceil(workers / max(1, gpus_per_node // gpus))
