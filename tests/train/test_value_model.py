"""The value model on the tiny model: the policy's backbone, a zero head, padding, save/load and learning."""

import math
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from hpcrl.rundir import current_umask
from hpcrl.train.algorithms.gae import gae_advantages, outcome_token_rewards
from hpcrl.train.algorithms.value import explained_variance, value_loss
from hpcrl.train.value_model import HEAD_FILE, ValueModel

IDS = torch.tensor([[5, 12, 7, 30, 9, 14], [8, 21, 40, 0, 0, 0]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])


@pytest.fixture
def value_model(tiny_model):
    return ValueModel.from_pretrained(tiny_model)


def test_backbone_is_the_policys_and_the_head_starts_at_zero(value_model, tiny_model):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).model.state_dict()
    backbone = value_model.backbone.state_dict()
    assert backbone.keys() == policy.keys()
    assert all(torch.equal(backbone[name], policy[name]) for name in policy)
    assert value_model.head.in_features == 64 and value_model.head.out_features == 1
    values = value_model(IDS, ATTENTION)
    assert values.shape == (2, 6) and values.dtype == torch.float32
    assert (values == 0).all()  # the fresh head: every value exactly 0 before the first update


def test_values_are_the_head_on_the_last_hidden_state(value_model, tiny_model):
    torch.manual_seed(0)
    torch.nn.init.normal_(value_model.head.weight)
    torch.nn.init.normal_(value_model.head.bias)
    with torch.no_grad():
        values = value_model(IDS, ATTENTION)
        hidden = AutoModel.from_pretrained(tiny_model, dtype=torch.float32)(input_ids=IDS[:1]).last_hidden_state
        expected = hidden[0] @ value_model.head.weight[0] + value_model.head.bias[0]
    torch.testing.assert_close(values[0], expected, atol=1e-5, rtol=0)
    assert values[0].std() > 0.1  # one value per token, not one per sequence


def test_padding_changes_no_real_value_and_reads_zero(value_model):
    torch.nn.init.normal_(value_model.head.weight, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        batched = value_model(IDS, ATTENTION)
        alone = value_model(IDS[1:, :3], ATTENTION[1:, :3])
        garbage = value_model(torch.where(ATTENTION == 1, IDS, 77), ATTENTION)  # other pad ids
    torch.testing.assert_close(batched[1, :3], alone[0], atol=1e-5, rtol=0)
    assert (batched[1, 3:] == 0).all()
    torch.testing.assert_close(garbage, batched, atol=0, rtol=0)
    assert batched[1, :3].abs().min() > 0


def test_save_and_load_round_trip_exactly(value_model, tmp_path):
    torch.nn.init.normal_(value_model.head.weight, generator=torch.Generator().manual_seed(2))
    torch.nn.init.constant_(value_model.head.bias, 0.25)
    first = value_model.save_pretrained(tmp_path / "critic")
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "model.safetensors", HEAD_FILE]
    # the umask's mode, not safetensors' 0600: a team on a shared cluster reads the critic too
    assert {stat.S_IMODE(p.stat().st_mode) for p in first.iterdir()} == {0o666 & ~current_umask()}
    loaded = ValueModel.from_pretrained(first)
    before, after = value_model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    second = loaded.save_pretrained(tmp_path / "again")
    for name in ("config.json", "model.safetensors", HEAD_FILE):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    with torch.no_grad():
        assert torch.equal(loaded(IDS, ATTENTION), value_model(IDS, ATTENTION))
    # saving over an existing directory replaces it and leaves no temporary directory behind
    value_model.save_pretrained(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "critic"]


def test_save_takes_a_gathered_state_dict(value_model, tmp_path):
    state = {name: tensor.clone() for name, tensor in value_model.state_dict().items()}
    state["head.bias"] = torch.tensor([3.0])
    out = value_model.save_pretrained(tmp_path / "critic", state_dict=state)
    assert ValueModel.from_pretrained(out).head.bias.item() == 3.0
    assert value_model.head.bias.item() == 0.0


def test_a_head_of_the_wrong_size_is_refused(tiny_model, tmp_path):
    critic = ValueModel.from_pretrained(tiny_model).save_pretrained(tmp_path / "critic")
    save_file({"weight": torch.zeros(1, 8), "bias": torch.zeros(1)}, critic / HEAD_FILE)
    with pytest.raises(ValueError, match=r"value_head.safetensors does not fit a backbone of hidden size 64"):
        ValueModel.from_pretrained(critic)


def test_a_directory_missing_backbone_weights_is_refused(tiny_model, tmp_path):
    # transformers would initialise the missing weight at random and carry on; a critic must not
    broken = Path(shutil.copytree(tiny_model, tmp_path / "broken"))
    weights = load_file(broken / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"the backbone's weights \['norm.weight'\] are missing"):
        ValueModel.from_pretrained(broken)


def test_a_few_steps_of_value_loss_fit_fixed_returns(value_model):
    # rows answered right (reward 1) and wrong (0): GAE with gamma = lam = 1 and zero values makes each
    # response token's return its row's reward; the critic must tell the rows apart from their tokens
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (4, 10))
    attention = torch.ones_like(ids)
    mask = torch.zeros(4, 9)
    mask[:, 4:] = 1.0  # values[:, :-1] line up with the [B, T-1] per-token layout
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0, 1.0, 0.0]), mask)
    _, returns = gae_advantages(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
    optimizer = torch.optim.Adam(value_model.parameters(), lr=1e-3)
    losses = []
    for _ in range(12):
        values = value_model(ids, attention)[:, :-1]
        loss, _ = value_loss(values, values.detach(), returns, mask, math.inf)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(0.25)  # values 0, returns 1 or 0: 0.5 * mean of (0 - R)^2 = 0.5 * 0.5
    # values that ignore the tokens do no better than the mean return 0.5: 0.5 * 0.25 = 0.125
    assert losses[-1] < 0.05, losses
    with torch.no_grad():
        assert explained_variance(value_model(ids, attention)[:, :-1], returns, mask) > 0.5
