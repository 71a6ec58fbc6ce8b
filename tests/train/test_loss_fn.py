"""The engines' loss functions: the actor's takes per-token advantages where the batch has them (GAE), and the
critic's is the clipped value loss against the batch's returns around its old values."""

from types import SimpleNamespace

import pytest
import torch

from hpcrl.config.schema import AlgorithmConfig, Config
from hpcrl.rpc.messages import SequenceBatch, SequenceData, TrainStep
from hpcrl.train.batch import Normalizer, Sequence, collate
from hpcrl.train.loss import make_loss_fn, make_value_loss_fn
from hpcrl.train.service import TrainerService

CFG = AlgorithmConfig(loss_agg="token_mean", advantage="gae", value_clip=0.2)


def batch(**fields):
    seqs = [
        Sequence([1, 2, 3, 4], [0, 0, 1, 1], advantage=5.0, old_logprobs=[0.0, 0.0, -1.0, -2.0], **fields),
    ]
    return collate(seqs, pad_id=0, device=torch.device("cpu"))


def test_the_actor_uses_each_tokens_own_advantage_not_the_sequences():
    mb = batch(token_advantages=[0.0, 0.0, 1.5, -0.5])
    logprobs = torch.tensor([[-9.0, -1.0, -2.0]], requires_grad=True)  # column t is about token t + 1
    loss, _ = make_loss_fn(CFG, max_new_tokens=2)(logprobs, mb, Normalizer(tokens=2, sequences=1))
    loss.backward()
    # ratio 1 (logprobs == old): d(-A * ratio)/dlogprob = -A per token, divided by the 2 loss tokens
    assert logprobs.grad.tolist() == [[0.0, -0.75, 0.25]]


def test_without_token_advantages_the_sequences_advantage_is_every_tokens():
    logprobs = torch.tensor([[-9.0, -1.0, -2.0]], requires_grad=True)
    loss, _ = make_loss_fn(CFG, max_new_tokens=2)(logprobs, batch(), Normalizer(tokens=2, sequences=1))
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -2.5, -2.5]]


def test_the_critics_loss_is_the_clipped_value_loss_around_the_old_values():
    mb = batch(returns=[0.0, 0.0, 1.0, 1.0], old_values=[0.0, 0.0, 0.5, 0.95])
    values = torch.tensor([[0.0, 0.5, 1.2]], requires_grad=True)  # token 3's value moved 0.25 past old + clip
    loss, metrics = make_value_loss_fn(CFG, max_new_tokens=2)(values, mb, Normalizer(tokens=2, sequences=1))
    # token 2: 0.5 * (0.5 - 1)^2 = 0.125; token 3: max(0.5*(1.2-1)^2, 0.5*(1.15-1)^2) = 0.02, unclipped wins
    assert loss.item() == pytest.approx((0.125 + 0.02) / 2)
    assert metrics["clip_frac"].item() == 0.0
    loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, -0.25, 0.1])


def test_value_clip_zero_turns_clipping_off_and_a_batch_without_returns_is_refused():
    mb = batch(returns=[0.0, 0.0, 1.0, 1.0], old_values=[0.0, 0.0, 0.0, 0.0])
    values = torch.tensor([[0.0, 1.5, 1.5]])  # past the return, and further than 0.2 from the old values
    off = make_value_loss_fn(AlgorithmConfig(value_clip=0.0), 2)(values, mb, Normalizer(2, 1))
    on = make_value_loss_fn(AlgorithmConfig(value_clip=0.2), 2)(values, mb, Normalizer(2, 1))
    assert off[0].item() == pytest.approx(0.5 * 0.5**2) and off[1]["clip_frac"].item() == 0.0
    assert on[0].item() == pytest.approx(0.5 * 0.8**2) and on[1]["clip_frac"].item() == 1.0  # clamped to 0.2
    with pytest.raises(ValueError, match="needs returns and old_values"):
        make_value_loss_fn(CFG, 2)(values, batch(), Normalizer(2, 1))


def test_a_batch_without_behaviour_logprobs_is_refused_naming_the_sequences():
    # before: the current policy's logprobs stood in for them, so every ratio was 1 and nothing was ever clipped
    seqs = [Sequence([1, 2, 3], [0, 1, 1], 1.0) for _ in range(3)]  # (the wire sends them on all or on none)
    mb = collate(seqs[:1], pad_id=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="needs the behaviour logprobs"):
        make_loss_fn(CFG, max_new_tokens=2)(torch.zeros(1, 2), mb, Normalizer(tokens=2, sequences=1))
    service = TrainerService(SimpleNamespace(step=0), Config(), rank=0)
    with pytest.raises(ValueError, match=r"sequence\(s\) 0, 1, 2 of this rank's 3 have no old_logprobs"):
        service.train_step(TrainStep(SequenceBatch.pack([SequenceData(**vars(s)) for s in seqs]), 1.0))


def test_the_in_step_mismatch_is_measured_against_server_logprobs_only():
    # under recompute the behaviour logprobs are the trainer's own: a gap to them measures nothing
    logprobs = torch.tensor([[-9.0, -1.5, -2.0]])  # token 2's logprob moved 0.5 from old_logprobs' -1.0
    _, server = make_loss_fn(CFG, max_new_tokens=2)(logprobs, batch(), Normalizer(tokens=2, sequences=1))
    assert float(server["mismatch_abs_mean"]) == pytest.approx(0.25) and float(server["mismatch_abs_max"]) == 0.5
    recompute = AlgorithmConfig(loss_agg="token_mean", advantage="gae", behaviour_logprobs="recompute")
    _, metrics = make_loss_fn(recompute, max_new_tokens=2)(logprobs, batch(), Normalizer(tokens=2, sequences=1))
    assert not [k for k in metrics if k.startswith("mismatch_")], metrics
    assert metrics and set(metrics) == {k for k in server if not k.startswith("mismatch_")}, "the loss's own stay"
