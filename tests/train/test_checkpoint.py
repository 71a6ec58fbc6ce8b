"""Sharded checkpoints in this process (1 rank); the 2-rank resume runs in test_engine_fsdp.py."""

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from hpcrl.config.schema import TrainConfig
from hpcrl.models.tiny import make_tiny_model
from hpcrl.train.batch import Sequence
from hpcrl.train.checkpoint import STATE_FILE, load_checkpoint, save_checkpoint
from hpcrl.train.dist import init_distributed
from hpcrl.train.engine import Engine

TRAIN = TrainConfig(lr=1e-3, weight_decay=0.01, warmup_steps=1, lr_schedule="cosine", micro_batch_tokens=32)


@pytest.fixture(scope="module")
def new_engine(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    created = not dist.is_initialized()
    info = init_distributed()

    def make(train: TrainConfig = TRAIN) -> Engine:
        engine = Engine(model, train, dist=info, total_steps=8)
        engine.setup()
        return engine

    yield make
    if created:
        dist.destroy_process_group()


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 99, (6, 11), generator=gen).tolist()
    advantages = torch.randn(6, generator=gen).tolist()
    return [
        Sequence(input_ids=row, loss_mask=[0] * 3 + [1] * 8, advantage=a)
        for row, a in zip(ids, advantages, strict=True)
    ]


def _loss(logprobs, mb, norm):
    return -(mb.advantages[:, None] * logprobs * mb.loss_mask).sum() / norm.tokens, {}


def test_resume_continues_bit_identically(new_engine, tmp_path):
    engine = new_engine()
    for step in range(3):
        engine.train_step(_batch(step), _loss)
    path = save_checkpoint(engine, tmp_path / "ckpt")
    expected = engine.train_step(_batch(3), _loss)
    expected_state = engine.full_state_dict()

    resumed = new_engine()
    load_checkpoint(resumed, path)
    assert resumed.step == 3
    got = resumed.train_step(_batch(3), _loss)
    assert got == expected  # loss, grad norm, lr and step, exactly
    state = resumed.full_state_dict()
    assert all(torch.equal(state[name], expected_state[name]) for name in expected_state)


def test_a_resume_trains_at_its_own_learning_rate_and_weight_decay(new_engine, tmp_path):
    # torch's load_state_dict restores the checkpoint's lr, initial_lr and weight_decay in the optimizer's param
    # groups and its base_lrs in the schedule: the resumed run's train.lr and train.weight_decay must win
    engine = new_engine()
    for step in range(3):
        engine.train_step(_batch(step), _loss)
    path = save_checkpoint(engine, tmp_path / "ckpt")

    resumed = new_engine(replace(TRAIN, lr=4e-3, weight_decay=0.05))
    load_checkpoint(resumed, path)
    cosine = [0.5 * (1 + math.cos(math.pi * (update - 1) / 7)) for update in (3, 4)]  # 1 warm-up update, 8 in all
    groups = resumed.optimizer.param_groups
    assert [(g["lr"], g["initial_lr"], g["weight_decay"]) for g in groups] == [(4e-3 * cosine[0], 4e-3, 0.05)]
    assert resumed.train_step(_batch(3), _loss)["lr"] == 4e-3 * cosine[0]
    assert groups[0]["lr"] == pytest.approx(4e-3 * cosine[1], rel=1e-12)

    # the optimizer steps with it: at lr 0 (and no weight decay) the weights stay as the checkpoint has them
    still = new_engine(replace(TRAIN, lr=0.0, weight_decay=0.0))
    load_checkpoint(still, path)
    before = still.full_state_dict()
    still.train_step(_batch(3), _loss)
    after = still.full_state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_save_leaves_only_the_finished_directory_and_replaces_an_old_one(new_engine, tmp_path):
    engine = new_engine()
    save_checkpoint(engine, tmp_path / "ckpt")
    engine.train_step(_batch(0), _loss)
    save_checkpoint(engine, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert json.loads((tmp_path / "ckpt" / STATE_FILE).read_text())["step"] == 1


def test_an_interrupted_save_is_not_loaded(new_engine, tmp_path):
    engine = new_engine()
    save_checkpoint(engine, tmp_path / "ckpt")
    (tmp_path / "ckpt" / STATE_FILE).unlink()  # what a crash before the rename leaves, under .partial
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(new_engine(), tmp_path / "ckpt")
