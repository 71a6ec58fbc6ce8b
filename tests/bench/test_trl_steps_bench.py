"""bench/trl_steps.py: TRL's minibatches as hpcrl's sequences, and hpcrl replaying them to TRL's weights."""

import pytest
import torch
import trl_steps

from hpcrl.train.batch import collate


def test_a_trl_minibatch_becomes_unpadded_sequences_with_logprobs_at_their_tokens():
    pad = 0
    prompt_ids = torch.tensor([[pad, 5, 6, 7], [4, 5, 6, 7]])  # TRL pads prompts on the left
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    completion_ids = torch.tensor([[8, pad], [9, 1]])  # and completions on the right
    completion_mask = torch.tensor([[1, 0], [1, 1]])
    advantages = torch.tensor([1.5, -0.25])
    old = torch.tensor([[-0.1, 0.0], [-0.2, -0.3]])  # column j: completion token j's logprob

    first, second = trl_steps.to_sequences(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, old)

    assert first.input_ids == [5, 6, 7, 8] and second.input_ids == [4, 5, 6, 7, 9, 1]
    assert first.loss_mask == [0, 0, 0, 1] and second.loss_mask == [0, 0, 0, 0, 1, 1]
    assert first.advantage == 1.5 and second.advantage == -0.25
    assert first.old_logprobs == pytest.approx([0, 0, 0, -0.1])
    assert second.old_logprobs == pytest.approx([0, 0, 0, 0, -0.2, -0.3])
    # as the engine sees them: column t is about token t + 1, so the completion's logprobs sit where it is predicted
    mb = collate([first, second], pad_id=pad, device=torch.device("cpu"))
    assert mb.loss_mask.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 1]]
    assert mb.old_logprobs[1, 3:].tolist() == pytest.approx([-0.2, -0.3])
    assert mb.input_ids[1, 4:].tolist() == [9, 1]


def test_a_row_without_a_completion_token_is_refused_by_its_index():
    ones = torch.ones((2, 2), dtype=torch.long)
    mask = torch.tensor([[1, 1], [0, 0]])
    with pytest.raises(ValueError, match="row 1: 2 prompt and 0 completion tokens"):
        trl_steps.to_sequences(ones, ones, ones, mask, torch.zeros(2), torch.zeros((2, 2)))


def test_groups_split_between_minibatches_are_counted_once():
    assert trl_steps.split_groups(torch.tensor([0, 1, 8, 17]), torch.tensor([2, 16, 24]), group=8) == 2


def test_hpcrl_replaying_trls_minibatches_ends_at_trls_weights(tmp_path):
    """Measured (seed 0, 8 prompts x 8, 2 updates): losses equal to 7e-9, gradients to 5e-7 (of elements up to 0.09),
    parameters to 7e-6 = 0.014 lr: Adam's first step is lr * g / (|g| + 1e-8) per element, so an element whose
    gradient is ~1e-9 turns a 2e-10 rounding difference into 7e-6 (layers.0 v_proj). A real difference in the loss,
    the advantages, the logprobs' alignment or the optimizer moves many elements by ~lr = 5e-4."""
    pytest.importorskip("trl", reason="TRL is only for this benchmark: pip install trl==1.16.0")
    from hpcrl.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", seed=0, characters=trl_steps.ALPHABET, **trl_steps.TINY)
    record = trl_steps.run_trl_recorded(model_dir, seed=0, prompts=8, updates=2, work=tmp_path)
    ours, _ = trl_steps.replay_hpcrl(model_dir, record)

    assert [len(u["batch"]["advantages"]) for u in record.updates] == [32, 32]
    for trl, hp in zip(record.updates, ours, strict=True):
        assert hp["loss"] == pytest.approx(trl["loss"], abs=1e-6)
        assert hp["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-5)
        assert hp["lr"] == trl["lr"] == trl_steps.LR
        assert hp["clip_frac"] == pytest.approx(trl["clip"], abs=1e-6)
        assert hp["max_dgrad"] < 1e-5
        assert hp["max_dparam"] < 1e-4  # 0.2 lr; measured 7e-6
    assert ours[1]["clip_frac"] > 0  # the second update is off-policy: the old logprobs' alignment matters there
