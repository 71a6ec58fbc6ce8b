"""What a config names outside itself is checked before anything starts: a model directory without a config, a
tokenizer or weights, and a data file that is not there, fail the dry run, the doctor and the run itself in one
line (exit 2), before a run directory is made or a worker started."""

import json
import shutil

import pytest

from hpcrl.config import ConfigError
from hpcrl.config.preflight import check_model_dir, check_model_path
from tests.config.test_options import one_error_line, run_module
from tests.conftest import run_main


def started_nothing(runs) -> bool:
    """Nothing of a run in ``runs`` but Hydra's own record of the command (``.hydra/``): no config.yaml, no logs,
    no registry, so no worker."""
    return not [p for p in runs.rglob("*") if p.is_file() and ".hydra" not in p.parts]


def broken_models(tiny_model, tmp_path):
    """(a broken copy of the tiny model, what the error says is missing)."""
    cases = []
    for name, remove, missing in [
        ("no_config", ["config.json"], "has no config.json"),
        ("no_tokenizer", ["tokenizer.json"], "has no a tokenizer (tokenizer.json or tokenizer.model"),
        ("no_weights", ["model.safetensors"], "has no weights (*.safetensors or *.bin)"),
    ]:
        copy = tmp_path / name
        shutil.copytree(tiny_model, copy)
        for file in remove:
            (copy / file).unlink()
        cases.append((copy, missing))
    cases.append((tmp_path / "nowhere", "does not exist"))
    (tmp_path / "a_file").write_text("")
    cases.append((tmp_path / "a_file", "is not a directory"))
    return cases


def test_a_model_directory_needs_a_config_a_tokenizer_and_weights(tiny_model, tmp_path):
    check_model_dir(str(tiny_model))  # the real thing passes
    for path, missing in broken_models(tiny_model, tmp_path):
        with pytest.raises(ConfigError) as err:
            check_model_dir(str(path))
        assert err.value.path == "model.path" and missing in err.value.expected, (path, err.value)


def test_a_hub_id_as_model_path_says_hpcrl_downloads_nothing_and_how_to_get_a_local_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        check_model_dir("Qwen/Qwen2.5-0.5B-Instruct")
    assert err.value.expected.endswith(
        "does not exist; 'Qwen/Qwen2.5-0.5B-Instruct' looks like a Hugging Face Hub id, and hpcrl downloads nothing "
        "(cluster nodes often have no internet): on a machine that has it, `hf download Qwen/Qwen2.5-0.5B-Instruct "
        "--local-dir DIR`, then model.path=DIR on a filesystem the nodes share"
    )
    with pytest.raises(ConfigError) as err:  # a path that is no Hub id gets no such hint
        check_model_dir(str(tmp_path / "nowhere"))
    assert "Hub id" not in err.value.expected


@pytest.mark.parametrize("how", ["dry run", "run", "doctor"])
def test_a_bad_model_path_fails_before_anything_starts(tiny_model, tmp_path, how):
    (path, missing), *_ = broken_models(tiny_model, tmp_path)  # no config.json
    runs = tmp_path / "runs"
    overrides = [f"model.path={path}", "run.trial=t", f"run.root={runs}"]
    if how == "doctor":
        result = run_module("hpcrl.doctor", *overrides)
    else:
        result = run_main(*overrides, *(["run.dry_run=true"] if how == "dry run" else []), cwd=tmp_path)
    line = one_error_line(result)
    assert line.startswith(f"hpcrl: config error: model.path='{path}' is invalid: expected a Hugging Face model")
    assert missing in line
    assert started_nothing(runs)


@pytest.mark.parametrize("how", ["dry run", "run", "doctor", "sbatch"])
def test_a_missing_data_file_fails_before_anything_starts(tmp_path, how):
    runs = tmp_path / "runs"
    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "1+1?", "answer": "2"}\n')
    missing = tmp_path / "test.jsonl"
    overrides = ["experiment=gsm8k", f"dataset.train_files=[{train}]", f"dataset.eval_files=[{missing}]"]
    overrides += ["run.trial=t", f"run.root={runs}"]
    if how == "doctor":
        result = run_module("hpcrl.doctor", *overrides)
    elif how == "sbatch":
        result = run_module("hpcrl.sbatch", "controller", "cluster=slurm", *overrides, "--dry-run")
    else:
        result = run_main(*overrides, *(["run.dry_run=true"] if how == "dry run" else []), cwd=tmp_path)
    line = one_error_line(result)
    expected = f"dataset.eval_files=['{missing}'] is invalid: expected local data files: {missing} does not exist"
    assert line == f"hpcrl: config error: {expected} (resolved to {missing})"
    assert started_nothing(runs)


def test_a_data_file_of_another_kind_is_named(tmp_path):
    data = tmp_path / "train.csv"
    data.write_text("question,answer\n")
    result = run_main("dataset=files", f"dataset.train_files=[{data}]", "run.dry_run=true", cwd=tmp_path)
    assert f"expected local .jsonl, .json, .parquet files: {data} has another extension" in one_error_line(result)


def test_the_multirun_launcher_checks_before_it_submits(tmp_path):
    missing = tmp_path / "nowhere"
    result = run_main(
        "-m", "hydra/launcher=submitit_local", f"model.path={missing}", f"run.root={tmp_path}", cwd=tmp_path
    )
    assert "model.path=" in one_error_line(result) and "does not exist" in result.stderr
    assert not list(tmp_path.rglob(".submitit")), "no job may be submitted"


def mistakes(tmp_path) -> dict[str, tuple[list[str], str]]:
    """Mistakes that fail seconds into a real run, each as (overrides, the line that names it)."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(250)))
    files = ["dataset=files", f"dataset.train_files=[{data}]"]
    return {
        "reward that does not import": (
            ["reward.fn=nosuchpkg.rewards:exact"],
            "reward.fn='nosuchpkg.rewards:exact' is invalid: expected functions every reward process can import: "
            "reward function 'nosuchpkg.rewards:exact': cannot import module 'nosuchpkg.rewards': ModuleNotFoundError: "
            "No module named 'nosuchpkg'. The module must be importable in every process (installed, or on PYTHONPATH)",
        ),
        "missing column": (
            [*files, "dataset.prompt_column=q", "dataset.holdout=10"],
            f"dataset.train_files=['{data}'] is invalid: expected data that has what the config names: {data}: row 0: "
            "no column 'q' (named by dataset.prompt_column); the file's columns are: question, answer",
        ),
        "holdout leaving less than a batch": (
            files,  # the default: 200 of 250 rows held out, 64 prompts a step
            "dataset.holdout=200 is invalid: expected fewer rows held out: dataset.train_files hold 250 rows, and "
            "holding out 200 leaves 50 to train on, fewer than one batch (rollout.prompts_per_step=64); lower "
            "dataset.holdout, or set dataset.eval_files (held-out rows of their own)",
        ),
        "max_new_tokens beyond the context": (
            ["rollout.max_new_tokens=600"],
            "rollout.max_new_tokens=600 is invalid: expected at most 511: the model's context is 512 tokens (the tiny "
            "model is made with max_position_embeddings=512), which must hold a request's prompt (a token at least) "
            "and its max_new_tokens, or SGLang refuses the request (HTTP 400): with 600 it refuses every one; or "
            "inference.context_overflow=truncate, which cuts max_new_tokens to what each prompt leaves",
        ),
    }


@pytest.mark.parametrize("how", ["dry run", "run", "doctor"])
def test_mistakes_a_real_run_meets_late_fail_before_anything_starts_with_one_line(tmp_path, how):
    """Each failed seconds into a real run (the reward pool's import, the data's loading, the first evaluation's
    requests): the dry run and the doctor passed them."""
    for name, (overrides, expected) in mistakes(tmp_path).items():
        runs = tmp_path / "runs" / name.replace(" ", "_")
        overrides = [*overrides, "run.trial=t", f"run.root={runs}"]
        if how == "doctor":
            result = run_module("hpcrl.doctor", *overrides, cwd=tmp_path)
        else:
            result = run_main(*overrides, *(["run.dry_run=true"] if how == "dry run" else []), cwd=tmp_path)
        assert one_error_line(result) == f"hpcrl: config error: {expected}", name
        assert started_nothing(runs), name


def test_a_dry_run_says_how_the_data_is_split(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n\n" for i in range(250)))
    result = run_main("dataset=files", f"dataset.train_files=[{data}]", "dataset.holdout=50", "run.dry_run=true",
                      f"run.root={tmp_path}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        "INFO hpcrl.main: dataset: 250 rows in dataset.train_files: 200 to train on, 50 held out for evaluation "
        "(dataset.holdout=50, drawn with run.seed; dataset.eval_files sets held-out rows of their own)"
    ) in result.stderr


def test_a_checkpoint_as_model_path_is_evaluated_only_and_only_whole(tiny_model, tmp_path):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 4, "world_size": 1, "scheduler": {}}))
    (run / "config.yaml").write_text(f"model:\n  path: {tiny_model}\n")
    with pytest.raises(ConfigError) as err:  # training from it: that is a resume of its run
        check_model_path(str(step), evaluate_only=False)
    assert "not a run's checkpoint: evaluate one with run.max_steps=0, or go on training" in err.value.expected
    with pytest.raises(ConfigError) as err:  # no tensors: DCP's metadata is missing
        check_model_path(str(step), evaluate_only=True)
    assert err.value.expected.startswith("a complete checkpoint of a run: an incomplete checkpoint: the tensors' meta")
    (run / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="is not at"):
        check_model_path(str(step), evaluate_only=True)
    check_model_path(str(tiny_model), evaluate_only=True)  # a model directory is evaluated as it is


def test_evaluation_only_holds_out_rows_without_a_training_batch_left(tmp_path):
    from hpcrl.config.preflight import data_line
    from tests.config.compose import load

    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(250)))
    files = ["dataset=files", f"dataset.train_files=[{data}]", "dataset.prompt_column=question"]
    with pytest.raises(ConfigError, match="fewer than one batch"):  # a training run needs 64 rows left
        data_line(load(*files))
    assert "50 to train on, 200 held out" in data_line(load(*files, "run.max_steps=0"))


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        ("[q_proj,v_prj]", "module names SGLang's --lora-target-modules takes ("),
        (
            "[q_proj,qkv_proj]",
            "'qkv_proj' matches no Linear module of the model (Qwen2ForCausalLM); its Linear modules are named "
            "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']",
        ),
    ],
)
def test_lora_targets_are_modules_sglang_takes_and_the_model_has(tiny_model, targets, expected):
    from hpcrl.config.preflight import check_lora_targets
    from tests.config.compose import load

    for model in ([], ["model=local", f"model.path={tiny_model}"]):  # the tiny model's config, and a directory's
        check_lora_targets(load(*model, "train.lora.rank=8"))  # the default targets: all of them there
        with pytest.raises(ConfigError) as err:
            check_lora_targets(load(*model, "train.lora.rank=8", f"train.lora.target_modules={targets}"))
        assert err.value.path == "train.lora.target_modules" and expected in err.value.expected
