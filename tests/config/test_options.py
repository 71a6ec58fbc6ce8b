"""Nothing silently ignored: an unknown group option is one line and exit 2 from ``hpcrl.main``, ``hpcrl.sbatch``
and ``hpcrl.doctor`` alike, with the options and the closest one; ``--config-dir`` adds groups of your own to all
three; ``model.path=DIR`` alone means ``model=local``; a key the composed config would ignore is refused with the
option that makes it count."""

import importlib.util
import os
import subprocess
import sys

import pytest
import yaml

from hpcrl.config import ConfigError
from hpcrl.config.hydra import compose_config
from hpcrl.config.overrides import config_dirs_in, imply_group_options
from tests.conftest import CONF_DIR, REPO, run_main

# (group, a misspelled option, the closest option)
MISSPELLED = [
    ("experiment", "gsm8", "gsm8k"),
    ("algorithm", "grpoo", "grpo"),
    ("allocation", "cpu_tin", "cpu_tiny"),
    ("cluster", "slurm_locl", "slurm_local"),
    ("model", "locl", "local"),
    ("dataset", "gsm8", "gsm8k"),
    ("logger", "wandbb", "wandb"),
]


def options_of(group: str) -> str:
    return ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))


def run_module(module: str, *args: str, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpcrl: config error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(("group", "wrong", "closest"), MISSPELLED, ids=[m[0] for m in MISSPELLED])
def test_a_misspelled_group_option_is_one_line_naming_the_closest(main_cli, tmp_path, group, wrong, closest):
    line = one_error_line(main_cli(f"{group}={wrong}", "run.trial=bad", "run.dry_run=true"))
    assert line.startswith(f"hpcrl: config error: {group}={wrong!r} is invalid: expected an option of {group}: ")
    assert f"did you mean {closest!r}? options are {options_of(group)}" in line
    assert ("or a shorthand such as sglang:d4t2+fsdp:d8" in line) == (group == "allocation")
    assert not (tmp_path / "default" / "bad").exists(), "nothing may start on a bad option"


def test_every_option_of_a_sweep_is_checked_before_anything_runs(main_cli, tmp_path):
    line = one_error_line(main_cli("-m", "algorithm=grpo,dapoo", "run.trial=swept", "run.dry_run=true"))
    assert "algorithm='dapoo' is invalid" in line and "did you mean 'dapo'?" in line
    assert not (tmp_path / "default" / "swept").exists(), "not even the first job of the sweep may run"


@pytest.mark.parametrize("launcher", ["basic", "submitit_local"])
def test_every_job_of_a_sweep_is_checked_before_the_first_runs_or_is_submitted(main_cli, tmp_path, launcher):
    # each job's values compose; job 2's fail a check: they used to fail once jobs 0 and 1 had run to their end
    chosen = [f"hydra/launcher={launcher}"] if launcher != "basic" else []
    result = main_cli("-m", *chosen, "run.trial=swept", "train.lr=1e-4,-1", "algorithm=grpo,dapo", "run.dry_run=true")
    line = one_error_line(result)
    assert line.startswith("hpcrl: config error: job 2 of the sweep (train.lr=-1 algorithm=grpo): train.lr=-1.0 is ")
    assert not (tmp_path / "default" / "swept").exists(), "no job may run, and none be submitted"


def test_a_sweep_job_whose_run_directory_holds_an_earlier_run_is_refused_before_any_runs(main_cli, tmp_path):
    (tmp_path / "default" / "swept" / "1").mkdir(parents=True)
    (tmp_path / "default" / "swept" / "1" / "metrics.jsonl").write_text('{"step": 1}\n')
    line = one_error_line(main_cli("-m", "run.trial=swept", "algorithm=grpo,dapo", "run.dry_run=true"))
    assert line.startswith("hpcrl: config error: job 1 of the sweep (algorithm=dapo): recover.mode='off' is invalid")
    assert sorted(p.name for p in (tmp_path / "default" / "swept").iterdir()) == ["1"], "job 0 did not run"


@pytest.mark.parametrize("module", ["hpcrl.sbatch", "hpcrl.doctor"])
def test_sbatch_and_the_doctor_refuse_a_misspelled_option_as_main_does(module, tmp_path):
    args = ["controller", "--dry-run"] if module == "hpcrl.sbatch" else []
    result = run_module(module, *args, "cluster=slurm_locl", "experiment=gsm8k", f"run.root={tmp_path}")
    line = one_error_line(result)
    assert "cluster='slurm_locl' is invalid: expected an option of cluster: did you mean 'slurm_local'?" in line
    assert result.stdout == ""


@pytest.fixture
def site_dir(tmp_path):
    """A directory of config groups of one's own: a cluster (local, so that the doctor stays on this machine)
    and an algorithm."""
    conf = tmp_path / "myconf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "cluster" / "mybox.yaml").write_text("name: mybox\nkind: local\ngpus_per_node: 0\n")
    (conf / "algorithm").mkdir()
    (conf / "algorithm" / "my_grpo.yaml").write_text("name: my_grpo\nadvantage: group_norm\nclip_high: 0.3\n")
    return conf


def test_main_composes_groups_from_a_config_dir(main_cli, tmp_path, site_dir):
    result = main_cli("--config-dir", str(site_dir), "cluster=mybox", "algorithm=my_grpo", "run.dry_run=true")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["cluster"]["name"] == "mybox" and printed["algorithm"]["clip_high"] == 0.3
    # the options of both directories are listed, and the closest found among them
    line = one_error_line(main_cli(f"--config-dir={site_dir}", "cluster=mybx", "run.dry_run=true"))
    assert "did you mean 'mybox'? options are local, local_gpu, mybox, slurm, slurm_local" in line
    assert options_of("cluster") == "local, local_gpu, slurm, slurm_local"


def test_the_doctor_reads_a_config_dir(tmp_path, site_dir):
    result = run_module("hpcrl.doctor", "--config-dir", str(site_dir), "cluster=mybox", f"run.root={tmp_path / 'r'}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok    config: valid: allocation cpu:d1g0n1+fsdp:d1g0n1 on cluster mybox (local)" in result.stdout


def test_sbatch_reads_a_config_dir_and_passes_it_on_to_the_run(tmp_path):
    conf = tmp_path / "myconf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "cluster" / "mysite.yaml").write_text("name: mysite\nkind: slurm\ngpus_per_node: 8\npartition: big\n")
    result = run_module("hpcrl.sbatch", "controller", "cluster=mysite", "--config-dir", str(conf), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --partition=big" in result.stdout
    (command,) = [line for line in result.stdout.splitlines() if " -m hpcrl.main " in line]
    assert f"-m hpcrl.main --config-dir={conf} cluster=mysite " in command  # the job composes the same config


def test_config_dirs_are_read_from_every_form_of_the_flag():
    argv = ["--config-dir", "a", "-cd", "b", "--config-dir=c", "x=1", "-cp=d"]
    assert [p.name for p in config_dirs_in(argv)] == ["a", "b", "c", "d"]


def test_a_model_path_alone_means_a_local_model(main_cli, tiny_model):
    assert imply_group_options(["model.path=/m"]) == ["model.path=/m", "model=local"]
    assert imply_group_options(["model=tiny", "model.path=/m"]) == ["model=tiny", "model.path=/m"]
    result = main_cli(f"model.path={tiny_model}", "run.dry_run=true")
    assert result.returncode == 0, result.stderr
    model = yaml.safe_load(result.stdout)["model"]
    assert (model["source"], model["path"], model["dtype"]) == ("local", str(tiny_model), "bfloat16")


# (overrides, the key refused, the option its message names, the overrides fixed as it says)
DATA, MODEL = "dataset.train_files=[{data}]", "model.path={model}"
IGNORED = [
    (
        ["dataset.prompt_column=q"],
        "dataset.prompt_column",
        "dataset=files",
        ["dataset=files", DATA, "dataset.prompt_column=q"],
    ),
    (
        ["dataset=files", DATA, "dataset.train_size=10"],
        "dataset.train_size",
        "dataset=mod10",
        ["dataset.train_size=10"],
    ),
    ([MODEL, "model=tiny"], "model.path", "model=local", [MODEL]),
    ([MODEL, "model.tiny.hidden_size=32"], "model.tiny.hidden_size", "model=tiny", ["model.tiny.hidden_size=32"]),
    (
        ["checkpoint.keep=5"],
        "checkpoint.keep",
        "checkpoint.every_steps=N",
        ["checkpoint.keep=5", "checkpoint.every_steps=9"],
    ),
    (
        ["train.weight_sync_bucket_mb=64"],
        "train.weight_sync_bucket_mb",
        "train.weight_sync=distributed",
        ["train.weight_sync_bucket_mb=64", "train.weight_sync=distributed"],
    ),
    (
        ["inference.max_restarts=5"],
        "inference.max_restarts",
        "inference.on_server_exit=restart",
        ["inference.max_restarts=5", "inference.on_server_exit=restart"],
    ),
    (
        ["metrics.wandb.project=mine"],
        "metrics.wandb.project",
        "logger=wandb",
        ["metrics.wandb.project=mine", "logger=wandb"],
    ),
]


@pytest.mark.parametrize(("overrides", "key", "option", "fixed"), IGNORED, ids=[case[1] for case in IGNORED])
def test_a_key_the_config_would_ignore_is_refused_naming_the_option(
    tmp_path, tiny_model, overrides, key, option, fixed
):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1?", "q": "1+1?", "answer": "2"}\n' * 300)  # the preflight reads it: 100 train
    with pytest.raises(ConfigError) as err:
        compose_config([o.format(data=data, model=tiny_model) for o in overrides])
    assert err.value.path == key and err.value.expected.startswith(option)
    assert f"beside it: {key} counts only with" in err.value.expected
    if "logger=wandb" in fixed and importlib.util.find_spec("wandb") is None:
        return  # the config check wants wandb installed when it is a logger
    fixed = [o.format(data=data, model=tiny_model) for o in fixed]
    cfg = compose_config(fixed)  # as the message says: accepted, and the key counts
    assert str(getattr_path(cfg, key)) in {o.partition("=")[2] for o in fixed}


def getattr_path(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_refusal_is_one_line_from_the_command_line_too(main_cli):
    line = one_error_line(main_cli("dataset.prompt_template='Q: {prompt}'", "run.dry_run=true"))
    assert "dataset.prompt_template='Q: {prompt}' is invalid: expected dataset=files beside it" in line
    assert "(dataset.name is mod10)" in line


def test_a_file_list_with_the_synthetic_task_is_refused_even_from_a_yaml_file(tmp_path):
    exp = tmp_path / "conf" / "experiment"
    exp.mkdir(parents=True)
    (exp / "mine.yaml").write_text("# @package _global_\ndataset:\n  train_files: [x.jsonl]\n")
    result = run_main(f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "experiment=mine", cwd=tmp_path)
    line = one_error_line(result)
    assert "dataset.train_files=['x.jsonl'] is invalid: expected no files with dataset.name=mod10" in line
    assert "add dataset=files" in line
