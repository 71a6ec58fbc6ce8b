"""Every YAML under conf/ parses, composes on the schema and validates."""

import tempfile

import pytest
import yaml

from hpcrl.config import Config
from tests.config.compose import load
from tests.conftest import CONF_DIR

ALL_YAML = sorted(CONF_DIR.rglob("*.yaml"))
# options that only make sense with other settings: what each needs beside it
NEEDS = {
    "allocation/1node_8gpu": ["cluster=slurm"],
    "allocation/2node_16gpu": ["cluster=slurm"],
    "model/local": ["model.path=/models/some-model"],
    "dataset/files": ["dataset.train_files=[train.jsonl]"],
    "dataset/gsm8k": ["dataset.train_files=[train.jsonl]"],
    "experiment/gsm8k": ["dataset.train_files=[train.jsonl]"],
    "experiment/mod10_judge": [f"reward.model.path={tempfile.gettempdir()}"],  # its judge: any directory composes
}
# options named otherwise in their own field: gsm8k is the files source with GSM8K's columns and template
NAMES = {"dataset/gsm8k": "files"}

# the field in which each option names itself
NAMED_BY = {
    "algorithm": lambda c: c.algorithm.name,
    "cluster": lambda c: c.cluster.name,
    "model": lambda c: c.model.source,
    "dataset": lambda c: c.dataset.name,
}


def test_conf_has_every_group():
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    assert {"allocation", "cluster", "algorithm", "model", "dataset", "experiment"} <= groups
    for group, option in [
        ("allocation", "cpu_tiny"),
        ("allocation", "1node_8gpu"),
        ("allocation", "2node_16gpu"),
        ("cluster", "local"),
        ("cluster", "slurm"),
        ("cluster", "slurm_local"),
    ]:
        assert (CONF_DIR / group / f"{option}.yaml").is_file()
    assert {p.stem for p in (CONF_DIR / "algorithm").glob("*.yaml")} >= {
        "grpo",
        "ppo",
        "dr_grpo",
        "dapo",
        "reinforce_pp",
    }


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_every_yaml_parses(path):
    assert isinstance(yaml.safe_load(path.read_text()), dict)


# options of hpcrl's groups (a conf/hydra/ would hold Hydra's own, composed on Hydra's schemas)
GROUP_OPTIONS = [p for p in ALL_YAML if p.parent != CONF_DIR and p.relative_to(CONF_DIR).parts[0] != "hydra"]


@pytest.mark.parametrize("path", GROUP_OPTIONS, ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_every_group_option_composes_and_validates(path):
    group, option = path.parent.name, path.stem
    cfg = load(f"{group}={option}", *NEEDS.get(f"{group}/{option}", []))
    assert isinstance(cfg, Config)
    if group in NAMED_BY:
        assert NAMED_BY[group](cfg) == NAMES.get(f"{group}/{option}", option)


def test_default_config_is_the_tiny_cpu_job():
    cfg = load()
    assert (cfg.allocation.server.backend, cfg.allocation.server.workers) == ("cpu", 1)
    assert (cfg.allocation.trainer.backend, cfg.allocation.trainer.workers) == ("fsdp", 1)
    assert cfg.allocation.trainer.gpus_per_worker == 0
    assert cfg.cluster.kind == "local" and cfg.algorithm.name == "grpo"


def test_algorithms_differ_in_the_fields_that_define_them():
    grpo, dr, dapo, ppo = (load(f"algorithm={a}").algorithm for a in ("grpo", "dr_grpo", "dapo", "ppo"))
    assert (grpo.advantage, dr.advantage) == ("group_norm", "group_center")
    assert dr.loss_agg == "seq_mean_token_sum_norm" and dapo.loss_agg == "token_mean"
    assert dapo.clip_high > dapo.clip_low and dapo.drop_equal_reward_groups
    assert ppo.kl.coef > 0 and grpo.kl.coef == 0
    assert (ppo.kl.place, ppo.kl.estimator) == ("reward", "k1")
    assert ppo.advantage == "gae" and load("algorithm=ppo").allocation.critic.workers == 1, "PPO has a critic"
    reinforce = load("algorithm=reinforce_pp")
    assert reinforce.algorithm.advantage == "batch_norm" and reinforce.allocation.critic.workers == 0
    assert reinforce.algorithm.kl == ppo.kl and (reinforce.algorithm.group_size, ppo.group_size) == (4, 8)


def test_slurm_cluster_defaults_give_servers_twenty_minutes():
    cluster = load("cluster=slurm", "allocation=2node_16gpu").cluster
    assert cluster.roles["server"].setup_timeout_s == 1200
    assert cluster.roles["trainer"].setup_timeout_s == 600


def test_two_node_allocation_resolves_nodes():
    alloc = load("cluster=slurm", "allocation=2node_16gpu").allocation
    assert (alloc.server.gpus_per_worker, alloc.server.nodes) == (2, 1)
    assert (alloc.trainer.gpus_per_worker, alloc.trainer.nodes) == (1, 1)
    more = load("cluster=slurm", "allocation.spec=sglang:d8t2+fsdp:d16").allocation
    assert (more.server.nodes, more.trainer.nodes) == (2, 2)


def test_experiment_overlay_overrides():
    cfg = load("experiment=mod10_quick")
    assert cfg.run.experiment == "mod10_quick" and cfg.run.max_steps < load().run.max_steps
