"""The critic's engine under real torchrun, 2 ranks on CPU (gloo) against 1: its values start at 0, the value loss
falls, two ranks train like one process, a checkpoint recovers it exactly, and its export is a value model."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.train.value_model import ValueModel
from tests.conftest import REPO, run_torchrun
from tests.train.scripts.value_engine import batch

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "train" / "scripts" / "value_engine.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hpcrl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    out = tmp_path_factory.mktemp("critic")
    for n in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(SCRIPT)]
        run_torchrun([*cmd, str(model), str(out)], 240, f"value engine on {n} rank(s)")
    return model, out


def _result(out, world, rank=0):
    return json.loads((out / f"w{world}_rank{rank}.json").read_text())


def test_values_start_at_zero_and_the_value_loss_falls_with_the_critics_lr(runs):
    _, out = runs
    one = _result(out, 1)
    assert one["lr"] == 3e-3, "the critic trains at train.critic_lr, not the policy's lr"
    assert all(v == 0.0 for row in one["before"] for v in row), "a fresh zero head: every value 0"
    losses = [s["loss"] for s in one["steps"]]
    assert losses[-1] < 0.5 * losses[0], losses
    # the critic learned the sign of the return: +1 sequences get higher values than -1 ones on response tokens
    assert _mean_value(one["after"], sign=1) > _mean_value(one["after"], sign=-1) + 0.2


def _mean_value(values, sign):
    picked = [
        v
        for seq, row in zip(batch(), values, strict=True)
        if seq.returns[-1] * sign > 0
        for v, m in zip(row, seq.loss_mask, strict=True)
        if m
    ]
    return sum(picked) / len(picked)


def test_two_ranks_train_the_critic_like_one_process(runs):
    _, out = runs
    single, sharded = load_file(out / "w1.safetensors"), load_file(out / "w2.safetensors")
    assert single.keys() == sharded.keys() and "head.weight" in single
    # float32 sums in another order over two ranks: 1.07e-5 seen (session 13; not investigated)
    assert max(float((single[k] - sharded[k]).abs().max()) for k in single) < 2e-5
    one, two = _result(out, 1), _result(out, 2)
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["clip_frac"] == pytest.approx(b["clip_frac"])


def test_a_checkpoint_recovers_the_critic_exactly_and_its_export_is_a_value_model(runs):
    _, out = runs
    for rank in (0, 1):
        result = _result(out, 2, rank)
        assert result["reloaded_values"] == result["after"] and result["reloaded_step"] == 6
        assert result["step7"][0] == result["step7"][1], "the optimizer state came back too"
    exported = ValueModel.from_pretrained(out / "export")
    trained = load_file(out / "w2.safetensors")
    assert all(torch.equal(exported.state_dict()[k], trained[k]) for k in trained)
    # and its values are the engine's: rank 0's first sequence through the plain module
    seq = batch()[0]
    ids = torch.tensor([seq.input_ids])
    with torch.no_grad():
        values = exported(ids, torch.ones_like(ids))[0, :-1].tolist()
    assert values == pytest.approx(_result(out, 2, 0)["after"][0][1:], abs=1e-5)


@pytest.mark.parametrize("method", ["token_logprobs", "sequence_logprobs"])
def test_a_value_engine_refuses_to_give_logprobs(tmp_path, method):
    """Engine's logprob methods would hand back values under a logprob's name (or fail deep inside the forward)."""
    from hpcrl.config.schema import TrainConfig
    from hpcrl.train.value_engine import ValueEngine

    engine = ValueEngine(tmp_path, TrainConfig(), total_steps=10)
    with pytest.raises(TypeError, match=r"a value model has no token logprobs; ValueEngine\.sequence_values"):
        getattr(engine, method)([])


def test_a_critics_train_step_refuses_to_write_weights_for_the_servers():
    from hpcrl.rpc.messages import SequenceBatch, TrainStep
    from hpcrl.train.critic_service import CriticService

    service = object.__new__(CriticService)  # the check comes before the engine is touched
    with pytest.raises(ValueError, match="export_to='/w/v1'"):
        service.train_step(TrainStep(SequenceBatch.pack([]), 1.0, export_to="/w/v1"))
