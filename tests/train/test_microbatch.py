"""Token-budget packing and the cross-rank count padding, without torch.distributed."""

import math
import random

import pytest

from hpcrl.train.microbatch import equalize, pack, padded_tokens


def _check_partition(bins, lengths, limit):
    assert sorted(i for items in bins for i in items) == list(range(len(lengths)))
    for items in bins:
        assert items, "pack never returns an empty micro-batch"
        assert len(items) == 1 or padded_tokens(items, lengths) <= limit


@pytest.mark.parametrize("seed", range(20))
def test_every_sequence_once_and_within_the_padded_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 60))]
    limit = rng.choice([16, 64, 100, 256, 1000])
    _check_partition(pack(lengths, limit), lengths, limit)


def test_a_sequence_over_the_budget_gets_its_own_micro_batch():
    bins = pack([100, 3, 3, 250], max_tokens=10)
    assert sorted(bins) == [[0], [1, 2], [3]]


def test_equal_lengths_fill_the_fewest_micro_batches_evenly():
    bins = pack([10] * 16, max_tokens=40)
    assert len(bins) == math.ceil(160 / 40)
    assert [len(items) for items in bins] == [4, 4, 4, 4]


@pytest.mark.parametrize("seed", range(5))
def test_loads_are_balanced_within_one_sequence(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(20, 30) for _ in range(rng.randint(10, 40))]
    bins = pack(lengths, max_tokens=300)
    loads = [sum(lengths[i] for i in items) for items in bins]
    assert len(bins) == math.ceil(sum(lengths) / 300)
    assert max(loads) - min(loads) <= max(lengths), loads


def test_the_budget_counts_padding_not_just_real_tokens():
    # 1 long + 7 short: real tokens 60 + 7 fit 100, but padded to the long one they would be 8 * 60
    bins = pack([60] + [1] * 7, max_tokens=100)
    _check_partition(bins, [60] + [1] * 7, 100)
    assert [0] in bins


def test_packing_is_deterministic_and_longest_first():
    lengths = [5, 9, 9, 2, 7, 9, 1]
    first = pack(lengths, 20)
    assert first == pack(list(lengths), 20)
    for items in first:
        assert [lengths[i] for i in items] == sorted((lengths[i] for i in items), reverse=True)


def test_no_sequences_no_micro_batches():
    assert pack([], 64) == []


@pytest.mark.parametrize(("lengths", "limit"), [([3], 0), ([0, 2], 8)])
def test_bad_inputs_are_refused(lengths, limit):
    with pytest.raises(ValueError):
        pack(lengths, limit)


def test_equalize_splits_the_largest_micro_batches_first():
    lengths = [10, 9, 8, 7, 2, 1]
    bins = [[0, 1, 2, 3], [4, 5]]
    # the big one (4 x 10 padded tokens) is split first, into alternating halves
    assert equalize(bins, lengths, 3) == [[0, 2], [1, 3], [4, 5]]
    grown = equalize(bins, lengths, 5)
    assert all(grown), "splittable micro-batches are split before any empty one is added"
    assert sorted(i for items in grown for i in items) == list(range(6))
    assert bins == [[0, 1, 2, 3], [4, 5]], "the input is not modified"


def test_equalize_pads_with_empty_micro_batches_when_nothing_splits():
    assert equalize([[0]], [5], 4) == [[0], [], [], []]
    assert equalize([], [], 2) == [[], []]


def test_equalize_keeps_split_halves_within_the_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    bins = pack(lengths, 128)
    grown = equalize(bins, lengths, len(bins) + 7)
    assert len(grown) == len(bins) + 7
    _check_partition([items for items in grown if items], lengths, 128)


def test_equalize_refuses_to_shrink():
    with pytest.raises(ValueError, match="cannot shrink"):
        equalize([[0], [1]], [3, 3], 1)
