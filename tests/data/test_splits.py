import json
import logging
from dataclasses import replace

import pytest

from hpcrl.config.schema import DatasetConfig
from hpcrl.data import DataError, decode_columns, load_splits
from hpcrl.reward.registry import RewardFns


def _jsonl(path, n, start=0):
    path.write_text("".join(json.dumps({"q": f"q{i}", "a": i}) + "\n" for i in range(start, start + n)))
    return str(path)


def _cfg(**kwargs) -> DatasetConfig:
    return DatasetConfig(name="files", prompt_column="q", answer_column="a", prompt_template="Q: {prompt}", **kwargs)


def test_mod10_makes_both_splits():
    train, held_out = load_splits(DatasetConfig(train_size=30, eval_size=10), seed=1)
    assert (len(train), len(held_out)) == (30, 10)


def test_mod10_warns_that_files_are_ignored(caplog):
    load_splits(DatasetConfig(train_size=3, eval_size=3, train_files=["x.jsonl"]), seed=0)
    assert "train_files and dataset.eval_files are ignored" in caplog.text


def test_files_with_held_out_files(tmp_path):
    cfg = _cfg(train_files=[_jsonl(tmp_path / "t.jsonl", 5)], eval_files=[_jsonl(tmp_path / "e.jsonl", 2, start=100)])
    train, held_out = load_splits(cfg, seed=0, cache_dir=str(tmp_path / "cache"))
    assert train["prompt"] == [f"Q: q{i}" for i in range(5)] and train["answer"] == [str(i) for i in range(5)]
    assert held_out.to_list() == [{"prompt": "Q: q100", "answer": "100"}, {"prompt": "Q: q101", "answer": "101"}]


def test_without_held_out_files_holdout_rows_are_held_out_by_seed(tmp_path, caplog):
    cfg = _cfg(train_files=[_jsonl(tmp_path / "t.jsonl", 50)], holdout=10, eval_size=3)  # eval_size: mod10's only
    with caplog.at_level(logging.INFO, logger="hpcrl.data"):
        train, held_out = load_splits(cfg, seed=0, cache_dir=str(tmp_path / "cache"), batch=40)
    assert (len(train), len(held_out)) == (40, 10)
    assert (
        "dataset: 50 rows in dataset.train_files: 40 to train on, 10 held out for evaluation (dataset.holdout=10, "
        "drawn with run.seed; dataset.eval_files sets held-out rows of their own)"
    ) in caplog.messages
    assert set(train["prompt"]).isdisjoint(held_out["prompt"])
    assert set(train["prompt"]) | set(held_out["prompt"]) == {f"Q: q{i}" for i in range(50)}
    again = load_splits(cfg, seed=0, cache_dir=str(tmp_path / "cache"))[1]
    other = load_splits(cfg, seed=1, cache_dir=str(tmp_path / "cache"))[1]
    assert again["prompt"] == held_out["prompt"] != other["prompt"]


def test_holding_out_every_row_is_refused(tmp_path):
    cfg = _cfg(train_files=[_jsonl(tmp_path / "t.jsonl", 5)], holdout=5)
    with pytest.raises(DataError) as e:
        load_splits(cfg, seed=0, cache_dir=str(tmp_path / "cache"))
    assert str(e.value) == (
        "dataset.holdout=5 is invalid: expected fewer rows held out: dataset.train_files hold 5 rows, and holding out "
        "5 leaves none to train on; lower dataset.holdout, or set dataset.eval_files (held-out rows of their own)"
    )


def test_a_holdout_that_leaves_fewer_training_rows_than_a_batch_is_refused(tmp_path):
    """The default holdout (200 rows) out of a 250-row file trained on 50 rows, with an INFO line only."""
    cfg = _cfg(train_files=[_jsonl(tmp_path / "t.jsonl", 250)])
    assert cfg.holdout == 200
    with pytest.raises(DataError) as e:
        load_splits(cfg, seed=0, cache_dir=str(tmp_path / "cache"), batch=64)
    assert str(e.value) == (
        "dataset.holdout=200 is invalid: expected fewer rows held out: dataset.train_files hold 250 rows, and holding "
        "out 200 leaves 50 to train on, fewer than one batch (rollout.prompts_per_step=64); lower dataset.holdout, or "
        "set dataset.eval_files (held-out rows of their own)"
    )
    train, held_out = load_splits(replace(cfg, holdout=186), seed=0, cache_dir=str(tmp_path / "cache"), batch=64)
    assert (len(train), len(held_out)) == (64, 186)


def test_files_without_train_files_is_refused():
    with pytest.raises(DataError, match=r"dataset\.train_files is empty"):
        load_splits(_cfg(), seed=0)


def test_the_rows_carry_the_columns_the_reward_functions_take(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"q": f"q{i}", "a": i, "low": i, "high": 9, "x": 0}) + "\n" for i in range(4)))
    rewards = RewardFns.resolve("tests.reward.fixtures:in_range")
    _, held_out = load_splits(_cfg(train_files=[str(path)], eval_files=[str(path)]), seed=0, rewards=rewards)
    assert [decode_columns(r)["columns"] for r in held_out] == [{"low": i, "high": 9} for i in range(4)]


def test_mod10_rows_have_no_column_a_reward_needs():
    with pytest.raises(DataError) as e:
        load_splits(DatasetConfig(), seed=0, rewards=RewardFns.resolve("tests.reward.fixtures:in_range"))
    assert str(e.value) == (
        "dataset.name=mod10: row 0: no column 'low' (named by the parameter 'low' of reward function "
        "'tests.reward.fixtures:in_range'); its rows hold: prompt, answer"
    )
