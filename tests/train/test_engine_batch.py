"""Sequence checks and the shift from input_ids alignment to prediction alignment in collate."""

import pytest
import torch

from hpcrl.train.batch import Sequence, check_optional_fields, collate


def test_collate_shifts_per_token_fields_onto_the_predictions_and_pads():
    a = Sequence(
        input_ids=[5, 6, 7, 8],
        loss_mask=[0, 0, 1, 1],
        advantage=2.0,
        old_logprobs=[0.0, -0.1, -0.2, -0.3],
        versions=[-1, -1, 4, 5],
    )
    b = Sequence(input_ids=[9, 10], loss_mask=[0, 1], advantage=-1.0, old_logprobs=[0.0, -0.5], versions=[-1, 5])
    mb = collate([a, b], pad_id=0, device=torch.device("cpu"))
    assert mb.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # column t is about token t + 1: the logprob of input_ids[:, t + 1]
    assert mb.loss_mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert mb.old_logprobs is not None
    assert torch.allclose(mb.old_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 0.0]]))
    assert mb.versions is not None and mb.versions.tolist() == [[-1, 4, 5], [5, -1, -1]]
    assert mb.advantages.tolist() == [2.0, -1.0]
    assert mb.ref_logprobs is None and mb.prox_logprobs is None
    assert mb.size == 2


def test_collate_pads_every_float_field_after_the_shift_and_rounds_it_to_float32_once():
    """Each optional per-token field lands one column left of its token, zero-padded, with the float32 value of
    the number itself (one conversion, no detour through float64 arithmetic); a loss mask of 2 counts as 1."""
    fields = {"token_advantages": [0.0, 0.1, 1 / 3], "returns": [0.0, 2.5, -7.25], "old_values": [9.0, 0.7, 1e-8]}
    long = Sequence(input_ids=[5, 6, 7], loss_mask=[0, 2, 1], **fields)
    short = Sequence(input_ids=[8, 9], loss_mask=[0, 1], **{name: [4.0, -0.3] for name in fields})
    mb = collate([long, short], pad_id=1, device=torch.device("cpu"))
    for name, values in fields.items():
        got = getattr(mb, name)
        expected = torch.tensor([values[1:], [-0.3, 0.0]], dtype=torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, expected), (name, got)
    assert mb.loss_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert mb.input_ids.tolist() == [[5, 6, 7], [8, 9, 1]] and mb.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert mb.old_logprobs is None and mb.versions is None


@pytest.mark.parametrize(
    ("sequence", "match"),
    [
        (Sequence(input_ids=[1], loss_mask=[0]), "input_ids needs at least 2 tokens"),
        (Sequence(input_ids=[1, 2, 3], loss_mask=[0, 1]), "loss_mask has 2 entries but input_ids has 3"),
        (Sequence(input_ids=[1, 2], loss_mask=[1, 1]), r"loss_mask\[0\] must be 0"),
        (Sequence(input_ids=[1, 2], loss_mask=[0, 1], old_logprobs=[-1.0]), "old_logprobs has 1 entries"),
    ],
)
def test_malformed_sequences_are_named(sequence, match):
    with pytest.raises(ValueError, match=f"sequence 3: {match}"):
        sequence.validate(3)


def test_an_optional_field_is_on_every_sequence_or_none():
    with_ref = Sequence(input_ids=[1, 2], loss_mask=[0, 1], ref_logprobs=[0.0, -1.0])
    without = Sequence(input_ids=[1, 2], loss_mask=[0, 1])
    check_optional_fields([with_ref, with_ref])
    with pytest.raises(ValueError, match="sequence 1 has no ref_logprobs"):
        check_optional_fields([with_ref, without])
