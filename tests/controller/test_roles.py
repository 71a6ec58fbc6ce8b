"""The run's roles as launch specs: the critic is a torchrun role of the trainer's kind, only with workers, and
takes the trainer's resources (Slurm settings included) when the site names none for it."""

from dataclasses import replace

from hpcrl.config.schema import RoleResources
from hpcrl.controller.roles import role_specs
from tests.config.compose import load


def test_the_critic_is_a_torchrun_role_only_with_workers():
    assert [s.role for s in role_specs(load())] == ["server", "trainer"]
    specs = {s.role: s for s in role_specs(load("algorithm=ppo"))}
    assert list(specs) == ["server", "trainer", "critic"]
    critic = specs["critic"]
    assert critic.torchrun and critic.argv[-2:] == ["--role", "critic"] and critic.workers == 1


def test_without_resources_of_its_own_the_critic_takes_the_trainers():
    cfg = load("cluster=slurm", "algorithm=ppo", "allocation=1node_8gpu", "allocation.critic.workers=2")
    trainer = RoleResources(setup_timeout_s=900.0, cpus_per_worker=6, partition="gpu", time_min=90)
    cfg = replace(cfg, cluster=replace(cfg.cluster, roles={"server": cfg.cluster.roles["server"], "trainer": trainer}))
    critic = next(s for s in role_specs(cfg) if s.role == "critic")
    assert critic.resources == trainer and critic.cpus_per_worker == 6 and critic.setup_timeout_s == 900.0
    own = RoleResources(cpus_per_worker=3, partition="small")
    cfg = replace(cfg, cluster=replace(cfg.cluster, roles={**cfg.cluster.roles, "critic": own}))
    critic = next(s for s in role_specs(cfg) if s.role == "critic")
    assert critic.resources == own and critic.cpus_per_worker == 3
