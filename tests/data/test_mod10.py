import re

import pytest

from hpcrl.data.mod10 import make_mod10


def test_rows_are_single_digit_sums_mod_10():
    train, held_out = make_mod10(500, 100, seed=0)
    assert (len(train), len(held_out)) == (500, 100)
    for row in [*train, *held_out]:
        a, b = map(int, re.fullmatch(r"(\d)\+(\d)=", row["prompt"]).groups())
        assert row["answer"] == str((a + b) % 10)
    assert train.column_names == ["prompt", "answer"]
    assert len(set(train["prompt"])) > 90  # draws cover the 100 prompts


def test_same_seed_same_rows_other_seed_other_rows():
    assert make_mod10(50, 20, seed=3)[0]["prompt"] == make_mod10(50, 20, seed=3)[0]["prompt"]
    assert make_mod10(50, 20, seed=3)[1]["prompt"] == make_mod10(50, 20, seed=3)[1]["prompt"]
    assert make_mod10(50, 20, seed=3)[0]["prompt"] != make_mod10(50, 20, seed=4)[0]["prompt"]


def test_the_splits_are_drawn_with_different_seeds():
    train, held_out = make_mod10(50, 50, seed=0)
    assert train["prompt"] != held_out["prompt"]


def test_an_empty_split_keeps_its_columns():
    _, held_out = make_mod10(3, 0, seed=0)
    assert len(held_out) == 0 and held_out.column_names == ["prompt", "answer"]


@pytest.mark.parametrize(("train_size", "eval_size", "seed"), [(-1, 1, 0), (1, 2.5, 0), (1, 1, -1)])
def test_bad_sizes_and_seeds_are_refused(train_size, eval_size, seed):
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        make_mod10(train_size, eval_size, seed)
