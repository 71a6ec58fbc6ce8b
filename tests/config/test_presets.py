"""Real-model presets: ``experiment=gsm8k`` sets what a 0.5B-7B model needs, docs/quickstart.md's table says
both it and the default job's values as the configs have them, and a local model run with the tiny task's
settings still in force is warned about, naming each. And ``cluster=local_gpu``: one GPU machine without Slurm."""

import logging
import re

import pytest

from hpcrl.config.applies import warn
from hpcrl.config.preflight import TINY_TASK_SETTINGS, tiny_task_settings_in_force, warn_tiny_task_settings
from tests.config.compose import load
from tests.conftest import REPO

PAGE = (REPO / "docs" / "quickstart.md").read_text()


def table_rows() -> list[tuple[str, str, str]]:
    """(key, the default job's value, experiment=gsm8k's value) of the quickstart's side-by-side table."""
    table = PAGE[PAGE.index("| setting | the default job") :].split("\n\n")[0]
    return re.findall(r"^\| `([a-z_.]+)` \| ([^|]+?) \| ([^|]+?) \|", table, re.M)


def value_of(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def same(cell: str, actual) -> bool:
    """A table cell (``5e-4``, ``0 (never)``, `` `a:b` ``, ``false``) against a config value."""
    text = cell.strip("`").split(" (")[0].strip()
    if isinstance(actual, bool) or text in ("true", "false"):
        return text == str(actual).lower()
    if isinstance(actual, (int, float)):
        return float(text) == pytest.approx(float(actual), rel=1e-12)
    return text == str(actual)


@pytest.fixture(scope="module")
def configs(tiny_model):
    return load(), load("experiment=gsm8k", "dataset.train_files=[x.jsonl]", "model=local", f"model.path={tiny_model}")


def test_the_quickstart_table_says_what_both_configs_set(configs):
    default, gsm8k = configs
    rows = table_rows()
    assert len(rows) >= 10
    for key, tiny_cell, real_cell in rows:
        assert same(tiny_cell, value_of(default, key)), f"{key}: the table says {tiny_cell}, the default job has it"
        assert same(real_cell, value_of(gsm8k, key)), f"{key}: the table says {real_cell}, experiment=gsm8k has it"


def test_the_gsm8k_preset_sets_what_a_real_model_needs(configs):
    _, cfg = configs
    assert cfg.train.lr <= 1e-5 and cfg.train.warmup_steps > 0
    assert cfg.rollout.max_new_tokens >= 256 and cfg.rollout.prompts_per_step >= 32
    assert cfg.eval.stop_at_accuracy == 0 and cfg.eval.every_steps > 0 and cfg.checkpoint.every_steps > 0
    assert tiny_task_settings_in_force(cfg) == []
    assert {key for key, *_ in table_rows()} >= {key for key, *_ in TINY_TASK_SETTINGS}


def test_the_tiny_task_settings_are_the_default_jobs(configs):
    default, _ = configs
    for key, value, _ in TINY_TASK_SETTINGS:
        assert value_of(default, key) == value, f"TINY_TASK_SETTINGS has {key}={value}; the default job another"


def test_a_local_model_with_the_tiny_tasks_settings_is_warned_about_naming_each(tiny_model, caplog):
    cfg = load("model=local", f"model.path={tiny_model}", "dataset=files", "dataset.train_files=[x.jsonl]")
    with caplog.at_level(logging.WARNING, logger="hpcrl.config.preflight"):
        warn_tiny_task_settings(cfg)
    (record,) = caplog.records
    for named in ("train.lr=0.0005", "train.warmup_steps=0", "rollout.max_new_tokens=2", "eval.stop_at_accuracy=0.9"):
        assert named in record.getMessage()
    assert "dataset.name" not in record.getMessage(), "its data is its own"
    assert "experiment=gsm8k" in record.getMessage()
    caplog.clear()
    warn_tiny_task_settings(load())  # the tiny model: its own settings, no warning
    assert caplog.records == []


def test_the_warning_reaches_the_terminal_and_the_controller_log(main_cli, tmp_path, tiny_model):
    result = main_cli(f"model.path={tiny_model}", "train.lr=1e-6", "run.trial=w", "run.dry_run=true")
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "keeps the tiny task's" in line]
    assert "WARNING" in line and "rollout.max_new_tokens=2" in line and "train.lr" not in line
    assert line.split("] ", 1)[1] in (tmp_path / "default" / "w" / "logs" / "controller-0.log").read_text()


def test_one_gpu_machine_without_slurm_validates():
    cfg = load("allocation=1node_8gpu", "cluster=local_gpu")
    assert cfg.cluster.kind == "local" and cfg.cluster.gpus_per_node == 8
    server, trainer = cfg.allocation.server, cfg.allocation.trainer
    assert (server.workers, server.gpus_per_worker, server.nodes) == (2, 2, 1)
    assert (trainer.workers, trainer.gpus_per_worker, trainer.nodes) == (4, 1, 1)
    assert (
        load("allocation.spec=sglang:d1t2+fsdp:d2", "cluster=local_gpu", "cluster.gpus_per_node=4").cluster.kind
        == "local"
    )


def test_a_gpu_allocation_on_the_cpu_cluster_says_what_fixes_it(main_cli):
    result = main_cli("allocation=1node_8gpu", "run.dry_run=true")
    assert result.returncode == 2
    assert "on one GPU machine without Slurm use cluster=local_gpu (or set cluster.gpus_per_node=N)" in result.stderr


def test_slurm_settings_on_a_local_cluster_are_named_in_one_line_and_the_local_clusters_own_in_none(caplog):
    # before: every local run warned twice with a RoleResources dump, though the setup timeouts in it are used
    with caplog.at_level(logging.WARNING, logger="hpcrl.config.applies"):
        warn(load())
    assert caplog.records == []
    cfg = load("cluster.roles.server.setup_timeout_s=9")
    cfg.cluster.partition, cfg.cluster.roles["trainer"].mem_gb, cfg.cluster.controller.cpus = "gpu", 64, 4
    cfg.cluster.roles["server"].extra_sbatch = ["--exclusive"]  # as a site's cluster file would set them
    with caplog.at_level(logging.WARNING, logger="hpcrl.config.applies"):
        warn(cfg, "basic")  # the controller's job settings: for when it is submitted (-m hydra/launcher=...)
    (record,) = caplog.records
    assert record.getMessage() == (
        "these settings have no effect in this run: cluster.partition (only with cluster.kind=slurm or "
        "hydra/launcher=submitit_slurm; cluster.kind is local, hydra/launcher is basic); "
        "cluster.roles.server.extra_sbatch, cluster.roles.trainer.mem_gb (only with cluster.kind=slurm; cluster.kind "
        "is local)"
    )
