"""The engine in this process (a 1-rank gloo group, still FSDP2-sharded), and the worker under torchrun."""

import logging
import math
from dataclasses import replace

import pytest
import torch

from hpcrl.config.schema import TrainConfig
from hpcrl.train.batch import Sequence
from hpcrl.train.engine import Engine

TRAIN = TrainConfig(lr=1e-3, grad_clip=1.0, micro_batch_tokens=32)


@pytest.fixture
def make_engine(tiny_model, dist_info):
    def make(dtype="float32", total_steps=0, updates_per_step=1, **train) -> Engine:
        schedule = {"total_steps": total_steps, "updates_per_step": updates_per_step}
        engine = Engine(tiny_model, replace(TRAIN, **train), dtype, dist_info, **schedule)
        engine.setup()
        return engine

    return make


def _sequences(lengths, prompt=2, advantage=1.0):
    return [
        Sequence(
            input_ids=[3 + (7 * i + j) % 90 for j in range(n)],
            loss_mask=[0] * prompt + [1] * (n - prompt),
            advantage=advantage * (-1) ** i,
        )
        for i, n in enumerate(lengths)
    ]


def _padded(sequences):
    width = max(len(s.input_ids) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq.input_ids)] = torch.tensor(seq.input_ids)
        mask[row, : len(seq.input_ids)] = 1
    return ids, mask


def _reinforce(logprobs, mb, norm):
    mask = mb.loss_mask
    loss = -(mb.advantages[:, None] * logprobs * mask).sum() / norm.tokens
    return loss, {"logprob_mean": (logprobs.detach() * mask).sum() / mask.sum()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_are_the_tempered_log_softmax_of_the_next_token(make_engine, tiny_model, temperature):
    from transformers import AutoModelForCausalLM

    engine = make_engine()
    ids, mask = _padded(_sequences([9, 4, 13]))
    got = engine.token_logprobs(ids, mask, temperature)

    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        logits = plain(input_ids=ids, attention_mask=mask).logits
    want = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == (3, 12)
    valid = mask[:, 1:].bool()
    assert (got - want)[valid].abs().max() < 1e-5


def test_sequence_logprobs_are_aligned_with_input_ids(make_engine):
    engine = make_engine(micro_batch_tokens=16)  # several micro-batches
    sequences = _sequences([5, 12, 3, 8])
    rows = engine.sequence_logprobs(sequences, temperature=0.9)
    for seq, row in zip(sequences, rows, strict=True):
        assert len(row) == len(seq.input_ids) and row[0] == 0.0
        ids, mask = _padded([seq])
        alone = engine.token_logprobs(ids, mask, 0.9)[0]
        assert torch.allclose(torch.tensor(row[1:]), alone, atol=1e-6)


def test_train_step_reports_the_global_loss_and_token_weighted_metrics(make_engine):
    engine = make_engine(micro_batch_tokens=24)
    sequences = _sequences([10, 7, 12, 5, 9])
    ids, mask = _padded(sequences)
    logprobs = engine.token_logprobs(ids, mask)
    loss_mask = torch.zeros_like(logprobs)
    for row, seq in enumerate(sequences):
        loss_mask[row, : len(seq.loss_mask) - 1] = torch.tensor(seq.loss_mask[1:], dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in sequences])
    want_loss = -(advantages[:, None] * logprobs * loss_mask).sum() / loss_mask.sum()

    result = engine.train_step(sequences, _reinforce)
    assert result["microbatches"] > 1
    assert result["loss"] == pytest.approx(float(want_loss), abs=1e-6)
    assert result["logprob_mean"] == pytest.approx(float((logprobs * loss_mask).sum() / loss_mask.sum()), abs=1e-6)
    assert result["loss_tokens"] == loss_mask.sum() and result["tokens"] == sum(len(s.input_ids) for s in sequences)
    assert result["sequences"] == 5 and result["step"] == 1 == engine.step
    assert result["grad_norm"] > 0
    assert not torch.allclose(engine.token_logprobs(ids, mask), logprobs), "the step changed the weights"


def test_lr_warms_up_then_follows_the_cosine(make_engine):
    engine = make_engine(warmup_steps=2, lr_schedule="cosine", total_steps=6, grad_clip=0.0)
    results = [engine.train_step(_sequences([6, 6]), _reinforce) for _ in range(6)]
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in results)
    lrs = [r["lr"] for r in results]
    cosine = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx([1e-3 / 2, 1e-3, *(1e-3 * c for c in cosine)], rel=1e-6)


def test_the_schedule_counts_every_update_of_a_step(make_engine):
    # a run step takes updates_per_batch optimizer updates: a schedule in run steps that stepped on every update
    # ended its cosine half-way through a 2-update run, and warmed up over half the steps it was told
    engine = make_engine(warmup_steps=1, lr_schedule="cosine", total_steps=3, updates_per_step=2, grad_clip=0.0)
    lrs = [engine.train_step(_sequences([6, 6]), _reinforce)["lr"] for _ in range(6)]
    cosine = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx([1e-3 / 2, 1e-3, *(1e-3 * c for c in cosine)], rel=1e-6)
    assert min(lrs) == lrs[-1] > 0, "the smallest rate is the last update's, and it still learns"


def test_a_batch_without_loss_tokens_is_refused_before_any_forward(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="no token with loss_mask 1"):
        engine.train_step(_sequences([5, 5], prompt=5), _reinforce)
    assert engine.step == 0


def test_a_non_finite_gradient_raises_and_leaves_the_weights_alone(make_engine):
    engine = make_engine()
    ids, mask = _padded(_sequences([6, 6]))
    before = engine.token_logprobs(ids, mask)

    def nan_loss(logprobs, mb, norm):
        return (logprobs * mb.loss_mask).sum() * float("nan"), {}

    with pytest.raises(FloatingPointError, match="weights are unchanged"):
        engine.train_step(_sequences([6, 6]), nan_loss)
    assert engine.step == 0
    assert torch.equal(engine.token_logprobs(ids, mask), before)
    assert engine.train_step(_sequences([6, 6]), _reinforce)["step"] == 1


def test_bfloat16_on_cpu_warns_and_trains_in_float32(make_engine, caplog):
    with caplog.at_level(logging.WARNING, logger="hpcrl.train.engine"):
        engine = make_engine(dtype="bfloat16")
    assert "model.dtype=bfloat16 is ignored" in caplog.text
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int8"}, "model.dtype"),
        ({"train": replace(TRAIN, lr_schedule="linear")}, "lr_schedule"),
        ({"train": replace(TRAIN, lr_schedule="cosine", warmup_steps=5), "total_steps": 5}, "total_steps"),
        ({"train": replace(TRAIN, micro_batch_tokens=0)}, "micro_batch_tokens"),
    ],
)
def test_bad_arguments_fail_in_the_constructor(tmp_path, kwargs, match):
    kwargs.setdefault("train", TRAIN)
    with pytest.raises(ValueError, match=match):
        Engine(tmp_path, **kwargs)


def test_using_the_engine_before_setup_says_so(tmp_path):
    with pytest.raises(RuntimeError, match=r"setup\(\)"):
        Engine(tmp_path, TRAIN).token_logprobs(torch.zeros((1, 2), dtype=torch.long), torch.ones((1, 2)))


def test_one_float32_rank_trains_the_unsharded_model_exactly_as_fsdp2_would(make_engine, monkeypatch):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from hpcrl.train import engine as engine_module

    shards = engine_module._shards
    plain = make_engine()
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
    monkeypatch.setattr(engine_module, "_shards", lambda world_size, mp_policy: True)
    sharded = make_engine()
    assert all(isinstance(p, DTensor) for p in sharded.model.parameters())
    for step in range(3):
        a, b = (e.train_step(_sequences([6, 9, 4], advantage=1.0 + step), _reinforce) for e in (plain, sharded))
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    a, b = plain.full_state_dict(), sharded.full_state_dict()
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert not any(a[k].data_ptr() == p.data_ptr() for k, p in plain.model.named_parameters()), "a copy, not live"
    # mixed precision is FSDP2's too: bfloat16 compute over float32 masters keeps it on one rank
    assert shards(1, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert not shards(1, MixedPrecisionPolicy()) and shards(2, MixedPrecisionPolicy())
