"""Sharded checkpoints in this process (1 rank); the 2-rank resume runs in test_engine_fsdp.py."""

import json

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

    def make() -> Engine:
        engine = Engine(model, TRAIN, dist=info, total_steps=8)
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
