"""GSM8K-style files end to end: ``experiment=gsm8k`` composed by Hydra, rows loaded from jsonl and parquet,
prompts templated, final answers read from the worked solutions and checked by math-verify."""

import json

import pytest
import yaml
from datasets import Dataset

from hpcrl.data import load_splits
from hpcrl.reward.builtin import extract_answer
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.registry import resolve
from tests.config.compose import load
from tests.conftest import run_main

# openai/gsm8k's layout: a question, and a worked solution (with calculator annotations) ending in "#### <answer>"
ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A pie is cut into 8 slices and 4 are eaten. What fraction of the pie is left?",
        "answer": "8 - 4 = <<8-4=4>>4 slices are left, which is 4/8 = 1/2 of the pie.\n#### 1/2",
    },
    {
        "question": "Betty saves $250 a month for 4 months. How much has she saved?",
        "answer": "She saves 250 * 4 = <<250*4=1000>>1000 dollars.\n#### 1,000",
    },
]
FINAL = ["72", "1/2", "1,000"]


def write_rows(path, rows=ROWS) -> str:
    if path.suffix == ".parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def gsm8k_config(*overrides: str):
    return load("experiment=gsm8k", *overrides)


def test_the_experiment_selects_the_gsm8k_dataset_and_the_math_reward():
    cfg = gsm8k_config("dataset.train_files=[train.jsonl]")
    assert cfg.run.experiment == "gsm8k"
    assert cfg.reward.fn == "hpcrl.reward.builtin:math_verify_reward"
    assert (cfg.dataset.name, cfg.dataset.prompt_column, cfg.dataset.answer_column) == ("files", "question", "answer")
    assert cfg.rollout.max_new_tokens > load().rollout.max_new_tokens  # room for a worked solution


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_rows_load_with_templated_prompts_and_whole_solutions(tmp_path, suffix):
    train = write_rows(tmp_path / f"train{suffix}")
    held_out = write_rows(tmp_path / f"test{suffix}", ROWS[:1])
    cfg = gsm8k_config(f"dataset.train_files=['{train}']", f"dataset.eval_files=['{held_out}']")
    rows, eval_rows = load_splits(cfg.dataset, cfg.run.seed, cache_dir=str(tmp_path / "cache"))
    assert rows["answer"] == [r["answer"] for r in ROWS] and eval_rows["answer"] == [ROWS[0]["answer"]]
    for prompt, row in zip(rows["prompt"], ROWS, strict=True):
        assert prompt.startswith(f"Question: {row['question']}\n") and prompt.endswith("\nAnswer:")
        # the template's {{ }} are literal braces, so the prompt names the answer forms the reward reads
        assert '"#### <answer>"' in prompt and "\\boxed{<answer>}" in prompt
    assert [extract_answer(a) for a in rows["answer"]] == FINAL


def test_without_held_out_files_holdout_rows_are_held_out(tmp_path):
    train = write_rows(tmp_path / "train.jsonl")
    cfg = gsm8k_config(f"dataset.train_files=['{train}']", "dataset.holdout=1")
    rows, eval_rows = load_splits(cfg.dataset, cfg.run.seed, cache_dir=str(tmp_path / "cache"))
    assert (len(rows), len(eval_rows)) == (2, 1)
    assert sorted([*rows["answer"], *eval_rows["answer"]]) == sorted(r["answer"] for r in ROWS)


# (completion, index of the reference row, reward): equal answers in other forms score 1, others 0
SCORED = [
    ("April 48, May 24, so 72 in all.\n#### 72", 0, 1.0),
    ("48 + 24 = 72. The answer is \\boxed{72}.", 0, 1.0),
    ("They sold 72 clips.", 0, 1.0),
    ("#### 72.0", 0, 1.0),
    ("48 + 24 = 71\n#### 71", 0, 0.0),
    ("48 + 24 = 72, and doubled that is 144", 0, 0.0),  # the last number is the answer read
    ("I cannot tell.", 0, 0.0),
    ("Half is left: 0.5", 1, 1.0),
    ("\\boxed{\\frac{1}{2}}", 1, 1.0),
    ("#### 1/2", 1, 1.0),
    ("\\boxed{\\frac{1}{4}}", 1, 0.0),
    ("She saved 1000 dollars.", 2, 1.0),
    ("#### 1,000", 2, 1.0),
    ("\\boxed{1,000}", 2, 1.0),
    ("\\boxed{100}", 2, 0.0),
]


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory):
    """The experiment's config and its training rows, loaded from a jsonl file."""
    tmp = tmp_path_factory.mktemp("gsm8k")
    cfg = gsm8k_config(f"dataset.train_files=['{write_rows(tmp / 'train.jsonl')}']", "dataset.holdout=1")
    rows, eval_rows = load_splits(cfg.dataset, cfg.run.seed, cache_dir=str(tmp / "cache"))
    by_answer = {r["answer"]: r for r in [*rows, *eval_rows]}
    return cfg, [by_answer[r["answer"]] for r in ROWS]  # in ROWS' order


@pytest.mark.parametrize(("completion", "row", "reward"), SCORED)
def test_the_configured_reward_reads_the_final_answer_of_a_solution(gsm8k, completion, row, reward):
    cfg, rows = gsm8k
    assert resolve(cfg.reward.fn)(rows[row]["prompt"], completion, rows[row]["answer"]) == reward


def test_the_reward_pool_scores_gsm8k_rows_with_the_configured_reward(gsm8k):
    # as the controller does: the spec is imported in reward processes, where math-verify's timeouts work
    cfg, rows = gsm8k
    items = [(rows[row]["prompt"], completion, rows[row]["answer"]) for completion, row, _ in SCORED]
    with RewardPool(cfg.reward.fn, workers=1, timeout_s=cfg.reward.timeout_s) as pool:
        outcomes = pool.score_sync(items)
    assert [o.error for o in outcomes] == [None] * len(SCORED)
    assert [o.value for o in outcomes] == [reward for _, _, reward in SCORED]


def test_a_dry_run_of_the_experiment_shows_the_math_reward(tmp_path):
    train = write_rows(tmp_path / "train.jsonl")
    overrides = ["experiment=gsm8k", f"dataset.train_files=['{train}']", "run.trial=dry", "run.dry_run=true"]
    overrides += ["dataset.holdout=1", "rollout.prompts_per_step=2"]  # 3 rows: one held out, a batch of two
    overrides += ["rollout.max_new_tokens=64"]  # the tiny model's context is 512: the preset's 512 fits no prompt
    result = run_main(*overrides, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["reward"]["fn"] == "hpcrl.reward.builtin:math_verify_reward"
    assert printed["dataset"]["train_files"] == [train] and printed["dataset"]["prompt_column"] == "question"
    assert (tmp_path / "runs" / "gsm8k" / "dry" / "config.yaml").is_file()
