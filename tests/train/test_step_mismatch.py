"""``loss.step_mismatch`` reduced by a real ``Engine`` over several micro-batches gives the whole batch's
``mismatch_metrics``: token means by the engine's loss-token weighting, per-sequence means through the rescaling
``step_mismatch`` applies, and ``mismatch_abs_max`` as a max, not a mean."""

from dataclasses import replace

import pytest
import torch

from hpcrl.config.schema import AlgorithmConfig, TrainConfig
from hpcrl.train.algorithms.off_policy import SEQUENCE_MISMATCH, mismatch_metrics
from hpcrl.train.batch import Sequence
from hpcrl.train.engine import Engine
from hpcrl.train.loss import make_loss_fn

# the batch below packs into micro-batches [0, 3], [2, 4], [5, 1]: two with two loss sequences, one with a sequence
# without a loss token next to one with
TRAIN = TrainConfig(lr=1e-3, grad_clip=1.0, micro_batch_tokens=28)
PROMPT = 2
# completion lengths differ (per-sequence means are not token means); the last sequence has no loss token
LENGTHS = [14, 4, 11, 6, 9, 5]
LOSS = [True, True, True, True, True, False]
# behaviour = trainer - offset: sequence 2 holds the largest gap (1.5) and sequence 1 two out-of-band tokens
OFFSETS = {0: [0.1, -0.2, 0.3], 1: [0.9, -0.8], 2: [0.05, -1.5, 0.2], 3: [-0.1], 4: [0.4, 0.0]}


@pytest.fixture
def engine(tiny_model, dist_info) -> Engine:
    engine = Engine(tiny_model, TRAIN, "float32", dist_info, total_steps=0, updates_per_step=1)
    engine.setup()
    return engine


def sequences() -> list[Sequence]:
    return [
        Sequence(
            input_ids=[3 + (5 * i + 3 * j) % 90 for j in range(n)],
            loss_mask=[0] * PROMPT + [int(loss)] * (n - PROMPT),
            advantage=(-1.0) ** i,
        )
        for i, (n, loss) in enumerate(zip(LENGTHS, LOSS, strict=True))
    ]


def with_behaviour(batch: list[Sequence], trainer: list[list[float]]) -> None:
    """Behaviour logprobs the trainer's minus a small per-token gap (``OFFSETS`` cycled over the sequence)."""
    for i, (seq, row) in enumerate(zip(batch, trainer, strict=True)):
        offsets = OFFSETS.get(i, [0.0])
        seq.old_logprobs = [lp - offsets[t % len(offsets)] if t else 0.0 for t, lp in enumerate(row)]


def padded(batch: list[Sequence], rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch as ``[B, T]`` tensors aligned with ``input_ids``: trainer, behaviour, loss mask."""
    width = max(LENGTHS)
    trainer, behaviour, mask = (torch.zeros(len(batch), width, dtype=torch.float64) for _ in range(3))
    for i, (seq, row) in enumerate(zip(batch, rows, strict=True)):
        n = len(seq.input_ids)
        trainer[i, :n] = torch.tensor(row, dtype=torch.float64)
        behaviour[i, :n] = torch.tensor(seq.old_logprobs, dtype=torch.float64)
        mask[i, :n] = torch.tensor(seq.loss_mask, dtype=torch.float64)
    return trainer, behaviour, mask


def test_the_steps_mismatch_metrics_are_the_whole_batchs(engine):
    batch = sequences()
    before = engine.sequence_logprobs(batch)  # the trainer's policy the step's forwards see
    with_behaviour(batch, before)
    want = mismatch_metrics(*padded(batch, before))

    loss_fn = make_loss_fn(AlgorithmConfig(loss_agg="token_mean"), max_new_tokens=12)
    seen: list[tuple[dict[str, float], float]] = []  # each micro-batch's own metrics and loss-token weight

    def recording(logprobs, mb, normalizer):
        seen.append((mismatch_metrics(logprobs.detach(), mb.old_logprobs, mb.loss_mask), float(mb.loss_mask.sum())))
        return loss_fn(logprobs, mb, normalizer)

    result = engine.train_step(batch, recording)
    assert result["microbatches"] == len(seen) == 3
    for name, value in want.items():
        assert result[name] == pytest.approx(value, abs=2e-6), name
    # the hand values the batch was built for: max |d| 1.5 (sequence 2), out-of-band tokens only in sequences 1
    # and 2 (|d| > ln 2: 0.9, -0.8, -1.5), so 2 of the 5 sequences with a loss token
    assert want["mismatch_abs_max"] == pytest.approx(1.5, abs=1e-6)
    assert want["mismatch_seq_out_frac"] == pytest.approx(2 / 5, abs=1e-12)

    # the split matters: the micro-batches' own per-sequence means, token-weighted without step_mismatch's
    # rescaling, and a token-weighted mean of their maxima, are not the whole batch's
    tokens = sum(weight for _, weight in seen)
    for name in (*SEQUENCE_MISMATCH, "mismatch_abs_max"):
        naive = sum(stats[name] * weight for stats, weight in seen) / tokens
        assert naive != pytest.approx(want[name], abs=1e-3), name
    assert result["mismatch_abs_max"] > result["mismatch_abs_mean"] > 0


def test_a_batch_in_one_micro_batch_gives_the_same_metrics(engine, tiny_model, dist_info):
    # the reference point: one micro-batch needs no rescaling and must agree with the split step on every metric
    whole = Engine(tiny_model, replace(TRAIN, micro_batch_tokens=1024), "float32", dist_info)
    whole.setup()
    batch = sequences()
    before = engine.sequence_logprobs(batch)
    with_behaviour(batch, before)
    loss_fn = make_loss_fn(AlgorithmConfig(loss_agg="token_mean"), max_new_tokens=12)
    split = engine.train_step(batch, loss_fn)
    one = whole.train_step(batch, loss_fn)
    assert one["microbatches"] == 1 < split["microbatches"]
    names = [name for name in one if name.startswith("mismatch_")]
    assert len(names) == 6
    assert {name: split[name] for name in names} == pytest.approx({name: one[name] for name in names}, abs=2e-6)
