"""``python -m hpcrl.main`` as a user runs it: a real process, the real conf/.

``run.dry_run=true`` validates, writes a new run's config.yaml (a resume's dry run writes none), prints the config
and stops, and under a submitit launcher submits nothing;
the job itself is tested in tests/controller.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import run_main, user_error


def test_dry_run_prints_and_writes_the_validated_config(main_cli, tmp_path):
    result = main_cli("run.trial=first", "run.dry_run=true")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["allocation"]["trainer"] == {
        "backend": "fsdp",
        "workers": 1,
        "gpus_per_worker": 0,
        "tp_size": 1,
        "nodes": 1,
        "min_workers": None,
    }
    assert "nothing was started" in result.stderr and "[controller:0]" in result.stderr
    run_dir = tmp_path / "default" / "first"
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == printed
    assert (run_dir / "logs" / "controller-0.log").read_text().count("[controller:0]") >= 2
    assert (run_dir / "registry").is_dir() and (run_dir / "checkpoints").is_dir()


def test_run_root_experiment_and_trial_set_the_run_directory(tmp_path):
    overrides = ["run.experiment=exp", "run.trial=t7", f"run.root={tmp_path / 'elsewhere'}", "run.dry_run=true"]
    result = run_main(*overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "elsewhere" / "exp" / "t7" / "config.yaml").is_file()


def test_shorthand_on_the_command_line(main_cli):
    result = main_cli("cluster=slurm", "allocation=sglang:d4t2+fsdp:d8", "run.trial=short", "run.dry_run=true")
    assert result.returncode == 0, result.stderr
    alloc = yaml.safe_load(result.stdout)["allocation"]
    assert alloc["spec"] == "sglang:d4t2+fsdp:d8"
    assert (alloc["server"]["backend"], alloc["server"]["workers"], alloc["server"]["tp_size"]) == ("sglang", 4, 2)
    assert (alloc["trainer"]["workers"], alloc["trainer"]["gpus_per_worker"]) == (8, 1)


def test_cfg_job_prints_the_composed_config(main_cli):
    result = main_cli("--cfg", "job", "algorithm=dapo")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["algorithm"]["name"] == "dapo" and printed["algorithm"]["clip_high"] == 0.28


def test_help_lists_the_groups_and_the_shorthand(main_cli):
    result = main_cli("--help")
    assert result.returncode == 0, result.stderr
    for group in ("allocation: 1node_8gpu, 2node_16gpu, cpu_tiny", "algorithm: dapo, dr_grpo, grpo, ppo"):
        assert group in result.stdout
    assert "cluster: local, local_gpu, slurm, slurm_local" in result.stdout
    assert "sglang:d4t2+fsdp:d8" in result.stdout


def test_multirun_with_the_basic_launcher_runs_each_job_in_its_own_directory(main_cli, tmp_path):
    result = main_cli("-m", "run.trial=swept", "algorithm=grpo,dapo", "run.dry_run=true")
    assert result.returncode == 0, result.stderr
    for num, algorithm in enumerate(["grpo", "dapo"]):
        written = yaml.safe_load((tmp_path / "default" / "swept" / str(num) / "config.yaml").read_text())
        assert written["algorithm"]["name"] == algorithm and written["run"]["trial"] == "swept"


def test_a_directory_an_earlier_run_left_steps_in_is_refused_unless_it_resumes(main_cli, tmp_path):
    run_dir = tmp_path / "default" / "used"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("the earlier run's\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    result = main_cli("run.trial=used", "run.dry_run=true")
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("hpcrl: config error: recover.mode='off' is invalid: expected auto to resume the run in")
    assert str(run_dir) in line and "metrics.jsonl up to line 2; checkpoints step_000002" in line
    assert "or a new run.trial" in line
    assert (run_dir / "config.yaml").read_text() == "the earlier run's\n", "nothing of the earlier run is touched"
    assert main_cli("run.trial=used", "run.dry_run=true", "recover.mode=auto").returncode == 0
    assert main_cli("run.trial=fresh", "run.dry_run=true").returncode == 0


def resumable_run(main_cli, tmp_path, trial: str):
    """A run directory as a run that wrote a checkpoint leaves it: its config.yaml and a complete checkpoint."""
    assert main_cli(f"run.trial={trial}", "run.dry_run=true").returncode == 0
    run_dir = tmp_path / "default" / trial
    (run_dir / "checkpoints" / "step_000002").mkdir()
    (run_dir / "checkpoints" / "step_000002" / "controller.json").write_text("{}")
    return run_dir


def test_a_resume_that_changes_what_its_checkpoints_hold_is_refused_naming_each_change(main_cli, tmp_path):
    # the checkpoint's model is 128 wide and its groups are 8: the run went on with them, config.yaml said otherwise
    run_dir = resumable_run(main_cli, tmp_path, "kept")
    saved = (run_dir / "config.yaml").read_text()
    overrides = ["model.tiny.hidden_size=32", "algorithm.group_size=4", "train.lr=0.001", "run.seed=3"]
    result = main_cli("run.trial=kept", "recover.mode=auto", *overrides, "run.dry_run=true")
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith(f"hpcrl: config error: run.seed=3 is invalid: expected 0, as the run in {run_dir} (config")
    assert "(changed: run.seed: 0 -> 3; algorithm.group_size: 8 -> 4; model.tiny.hidden_size: 128 -> 32);" in line
    assert "train.lr" not in line and "another run.trial" in line
    assert (run_dir / "config.yaml").read_text() == saved


def test_a_resume_lists_the_settings_it_changes_and_keeps_the_runs_config(main_cli, tmp_path):
    run_dir = resumable_run(main_cli, tmp_path, "changed")
    saved = (run_dir / "config.yaml").read_text()
    overrides = ["train.lr=0.001", "run.max_steps=9", "+cluster.env.A=1", "checkpoint.every_steps=3"]
    result = main_cli("run.trial=changed", *overrides, "recover.mode=auto", "run.dry_run=true")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["train"]["lr"] == 0.001
    (line,) = [line for line in result.stderr.splitlines() if "would change" in line]
    assert line.endswith(
        "would change these settings: run.max_steps: 200 -> 9; train.lr: 0.0005 -> 0.001; "
        "checkpoint.every_steps: 0 -> 3; cluster.env.A: '<unset>' -> '1'"
    )
    # a dry run resumes nothing: the run's config stays as it is, and none is written beside it
    assert (run_dir / "config.yaml").read_text() == saved
    assert sorted(p.name for p in run_dir.glob("config*")) == ["config.yaml"]


def test_a_resume_with_run_max_steps_below_its_checkpoint_is_refused_before_anything_starts(main_cli, tmp_path):
    run_dir = resumable_run(main_cli, tmp_path, "lowered")  # its checkpoint: step 2
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    result = main_cli("run.trial=lowered", "recover.mode=auto", "run.max_steps=1")
    assert user_error(result) == [
        f"hpcrl: config error: run.max_steps=1 is invalid: expected at least 2, the step of the newest checkpoint in "
        f"{run_dir / 'checkpoints'} that recover.mode=auto resumes from: below it nothing is left to train (to "
        "evaluate that checkpoint: run.max_steps=0 model.path=<the checkpoint> in another run.trial)"
    ]
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before, "nothing started, nothing written"
    # at the checkpoint's own step the run is complete (a requeued job exports again): not refused
    assert main_cli("run.trial=lowered", "recover.mode=auto", "run.max_steps=2", "run.dry_run=true").returncode == 0


def test_the_run_directory_config_loads_back_without_hydra(main_cli, tmp_path):
    from hpcrl.config.load import load_run_config

    assert main_cli("run.trial=reload", "algorithm=dapo", "run.dry_run=true").returncode == 0
    cfg = load_run_config(tmp_path / "default" / "reload" / "config.yaml")
    assert cfg.algorithm.name == "dapo" and cfg.allocation.trainer.workers == 1 and cfg.run.trial == "reload"


@pytest.mark.parametrize("launcher", ["submitit_slurm", "submitit_local"])
def test_a_dry_run_under_a_submitit_launcher_submits_nothing_and_prints_what_it_would(main_cli, tmp_path, launcher):
    # the check ran inside the submitted job: a dry run submitted one (here, without sbatch, submitit_slurm failed)
    result = main_cli("-m", f"hydra/launcher={launcher}", "run.trial=dry", "train.lr=1e-4,2e-4", "run.dry_run=true")
    assert result.returncode == 0, result.stderr
    settings, *jobs = yaml.safe_load_all(result.stdout)
    assert [(job["train"]["lr"], job["run"]["trial"]) for job in jobs] == [(1e-4, "dry"), (2e-4, "dry")]
    assert settings["_target_"].endswith("SlurmLauncher" if launcher == "submitit_slurm" else "LocalLauncher")
    if launcher == "submitit_slurm":  # hpcrl's settings for the controller's job, resolved from the cluster group
        assert (settings["name"], settings["timeout_min"], settings["mem_gb"]) == ("hpcrl-default", 60, 8)
    assert settings["submitit_folder"] == f"{tmp_path}/default/dry/.submitit/%j"
    assert f"--- # job 1 train.lr=0.0002: in {tmp_path}/default/dry/1" in result.stdout
    assert "nothing was submitted" in result.stderr
    assert not (tmp_path / "default").exists(), "nothing submitted, no run directory, no .submitit"


def test_the_controller_jobs_launcher_is_hpcrls_on_submitits_schema_without_hydras_deprecation_warning():
    # a conf/hydra/launcher/submitit_slurm.yaml was merged onto the plugin's schema of that name by Hydra's
    # "automatic schema matching", which warned on every composition (three times a submitit call)
    result = run_main("hydra/launcher=submitit_slurm", "--cfg", "hydra", "-p", "hydra.launcher")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    launcher = yaml.safe_load(result.stdout)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher["name"], launcher["partition"]) == (
        "hpcrl-${run.experiment}",
        "${hpcrl.controller:${cluster},partition}",
    )
    assert (launcher["array_parallelism"], launcher["max_num_timeout"]) == (256, "${cluster.controller.max_requeues}")


def test_a_bad_row_found_as_the_run_starts_is_one_line_and_exit_code_2(main_cli, tmp_path):
    # before: the run's traceback (16 lines) and "hpcrl: the run failed (DataError): ...", exit code 1
    data = tmp_path / "rows.jsonl"
    rows = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(300)]
    rows[100] = {"question": "100+1"}
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (line,) = user_error(main_cli("dataset=files", f"dataset.train_files=[{data}]", f"dataset.eval_files=[{data}]"))
    assert line.startswith("hpcrl: ")
    assert line.endswith(
        f"{data}: row 100 (line 101): column 'answer' is missing or null; expected a string or a number"
    )


def test_a_model_directory_whose_tokenizer_does_not_load_is_one_line_with_a_hint(main_cli, tmp_path, tiny_model):
    # before: transformers' traceback and "hpcrl: the run failed (KeyError): 'added_tokens'"
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").write_text("{}")
    line, hint = user_error(main_cli(f"model.path={model}"))
    assert line == f"hpcrl: the tokenizer in {model} does not load (KeyError: 'added_tokens')"
    assert hint == "    a model directory needs its tokenizer's files as save_pretrained wrote them (tokenizer.json, " \
                   "tokenizer_config.json)"  # fmt: skip


def test_the_slurm_launcher_without_slurm_here_is_one_line_and_submits_nothing(tmp_path, path_without_slurm):
    # before: submitit's traceback ('Could not detect "srun", are you indeed on a slurm cluster?'), exit code 1
    cmd = [sys.executable, "-m", "hpcrl.main", "-m", "hydra/launcher=submitit_slurm", f"run.root={tmp_path}"]
    env = {**os.environ, "PATH": path_without_slurm, "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    line, hint = user_error(result)
    assert line == (
        "hpcrl: hydra/launcher=submitit_slurm submits the controller as a Slurm job, but sbatch and srun are not on "
        "PATH here: nothing was submitted"
    )
    assert "run.dry_run=true" in hint
    assert list(tmp_path.iterdir()) == []


def test_workers_on_slurm_without_slurm_here_is_one_line_and_submits_nothing(tmp_path, path_without_slurm):
    # before: "hpcrl: the run failed (FileNotFoundError): [Errno 2] No such file or directory: 'sbatch'" after
    # its traceback, exit code 1
    cmd = [sys.executable, "-m", "hpcrl.main", "cluster=slurm", f"run.root={tmp_path}", "run.trial=t"]
    env = {**os.environ, "PATH": path_without_slurm, "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    line, hint = user_error(result)
    assert line == (
        "hpcrl: cluster.kind=slurm starts the workers as Slurm jobs, but sbatch, squeue, scancel are not on PATH "
        "here: nothing was submitted"
    )
    assert "cluster=local" in hint
    assert not (tmp_path / "default" / "t" / "slurm").exists(), "no submitit folder: nothing submitted"
