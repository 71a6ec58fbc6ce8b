"""The run's roles as launch specs: the critic is a torchrun role of the trainer's kind, only with workers, and
takes the trainer's resources (Slurm settings included) when the site names none for it."""

from dataclasses import replace

from hpcrl.config.schema import RoleResources
from hpcrl.controller import roles
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


def test_a_local_run_shares_this_machines_cores_among_its_training_ranks(monkeypatch):
    monkeypatch.setattr(roles, "usable_cores", lambda: 4)
    threads = lambda *o: {s.role: s.env.get("OMP_NUM_THREADS") for s in role_specs(load(*o))}  # noqa: E731
    assert threads() == {"server": None, "trainer": "4"}
    assert threads("allocation.trainer.workers=2") == {"server": None, "trainer": "2"}
    assert threads("algorithm=ppo") == {"server": None, "trainer": "2", "critic": "2"}
    assert threads("allocation.trainer.workers=3", "algorithm=ppo")["trainer"] == "1"
    assert threads("allocation.trainer.workers=8")["trainer"] == "1"  # never 0
    assert threads("+cluster.env.OMP_NUM_THREADS=3")["trainer"] == "3"  # the user's setting wins


def test_a_local_runs_training_ranks_wait_passively_at_openmp_barriers_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # the suite sets it for every process it starts
    policy = lambda *o: {s.role: s.env.get("OMP_WAIT_POLICY") for s in role_specs(load(*o))}  # noqa: E731
    assert policy("algorithm=ppo") == {"server": None, "trainer": "PASSIVE", "critic": "PASSIVE"}
    assert policy("+cluster.env.OMP_WAIT_POLICY=ACTIVE")["trainer"] == "ACTIVE"  # the user's setting wins
    slurm = ("cluster=slurm", "allocation=1node_8gpu")  # a Slurm rank has its cores to itself
    assert policy(*slurm) == {"server": None, "trainer": None}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # set where the controller runs: the ranks inherit it
    assert policy()["trainer"] is None


def test_on_slurm_a_rank_runs_as_many_threads_as_cpus_its_role_asks_for(monkeypatch):
    monkeypatch.setattr(roles, "usable_cores", lambda: 64)  # the controller's node says nothing about the workers'
    cfg = load("cluster=slurm", "algorithm=ppo", "allocation=1node_8gpu", "cluster.roles.trainer.cpus_per_worker=6")
    specs = {s.role: s for s in role_specs(cfg)}
    assert specs["trainer"].env["OMP_NUM_THREADS"] == "6"
    assert specs["critic"].env["OMP_NUM_THREADS"] == str(specs["critic"].cpus_per_worker)


def test_the_reward_model_is_a_server_role_of_its_own_only_with_workers(tmp_path):
    assert "reward_model" not in [s.role for s in role_specs(load())]
    cfg = load("allocation.reward_model.workers=2", f"reward.model.path={tmp_path}")
    specs = {s.role: s for s in role_specs(cfg)}
    assert list(specs)[-1] == "reward_model"
    rm = specs["reward_model"]
    assert rm.argv[-4:] == ["-m", "hpcrl.inference.worker", "--role", "reward_model"] and rm.workers == 2
    assert not rm.torchrun and rm.resources == cfg.cluster.roles["server"], "the servers' resources by default"
    own = RoleResources(setup_timeout_s=77.0, cpus_per_worker=3)
    cfg = replace(cfg, cluster=replace(cfg.cluster, roles={**cfg.cluster.roles, "reward_model": own}))
    rm = next(s for s in role_specs(cfg) if s.role == "reward_model")
    assert rm.resources == own and rm.setup_timeout_s == 77.0


def test_the_whole_run_batch_script_has_a_component_for_the_reward_model(tmp_path):
    from hpcrl.sbatch import render

    overrides = ["cluster=slurm_local", "allocation=cpu:d1+fsdp:d1g0+rm:cpu:d1", f"reward.model.path={tmp_path}"]
    script = render("hetjob", overrides, "python")
    assert "the controller (0), server (1), trainer (2), reward_model (3)" in script
    assert "#SBATCH --job-name=hpcrl-default-reward_model" in script
