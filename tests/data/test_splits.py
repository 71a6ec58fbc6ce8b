import json

import pytest

from hpcrl.config.schema import DatasetConfig
from hpcrl.data import DataError, load_splits


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


def test_without_held_out_files_eval_size_rows_are_held_out_by_seed(tmp_path):
    cfg = _cfg(train_files=[_jsonl(tmp_path / "t.jsonl", 50)], eval_size=10)
    train, held_out = load_splits(cfg, seed=0, cache_dir=str(tmp_path / "cache"))
    assert (len(train), len(held_out)) == (40, 10)
    assert set(train["prompt"]).isdisjoint(held_out["prompt"])
    assert set(train["prompt"]) | set(held_out["prompt"]) == {f"Q: q{i}" for i in range(50)}
    again = load_splits(cfg, seed=0, cache_dir=str(tmp_path / "cache"))[1]
    other = load_splits(cfg, seed=1, cache_dir=str(tmp_path / "cache"))[1]
    assert again["prompt"] == held_out["prompt"] != other["prompt"]


def test_holding_out_every_row_is_refused(tmp_path):
    cfg = _cfg(train_files=[_jsonl(tmp_path / "t.jsonl", 5)], eval_size=5)
    with pytest.raises(DataError, match=r"dataset\.eval_size=5 is invalid: the training files hold 5 rows"):
        load_splits(cfg, seed=0, cache_dir=str(tmp_path / "cache"))


def test_files_without_train_files_is_refused():
    with pytest.raises(DataError, match=r"dataset\.train_files is empty"):
        load_splits(_cfg(), seed=0)
