"""LoRA on the policy in this process (1 rank, unsharded): what trains, the targets' check, the KL reference, the
adapter's tensors and config. Checkpoints and exports: test_lora_files.py; two FSDP2 ranks: test_engine_fsdp.py."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from hpcrl.config.schema import Config, LoRAConfig, TrainConfig
from hpcrl.train.batch import Sequence
from hpcrl.train.dist import init_distributed
from hpcrl.train.engine import Engine
from hpcrl.train.lora import BaseReference, LoraAdapterRequest, lora_targets_problem
from hpcrl.train.weight_push import push_over_group, weight_specs

LORA = LoRAConfig(rank=4, alpha=8.0)
TRAIN = TrainConfig(lr=1e-2, weight_decay=0.01, micro_batch_tokens=64, lora=LORA)


@pytest.fixture(scope="module")
def dist_info():
    created = not dist.is_initialized()
    info = init_distributed()
    yield info
    if created:
        dist.destroy_process_group()


@pytest.fixture
def make_engine(tiny_model, dist_info):
    def make(train: TrainConfig = TRAIN) -> Engine:
        engine = Engine(tiny_model, train, dist=dist_info)
        engine.setup()
        return engine

    return make


def batch(step: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 60, (6, 12), generator=gen).tolist()
    advantages = torch.randn(6, generator=gen).tolist()
    rows = zip(ids, advantages, strict=True)
    return [Sequence(input_ids=r, loss_mask=[0] * 4 + [1] * 8, advantage=a) for r, a in rows]


def reinforce(logprobs, mb, norm):
    return -(mb.advantages[:, None] * logprobs * mb.loss_mask).sum() / norm.tokens, {}


def test_only_the_adapters_train_and_the_frozen_weights_never_get_a_gradient(make_engine):
    engine = make_engine()
    model = engine.model
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    frozen = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    # 2 layers x 7 targets x (A, B)
    assert len(adapters) == 28 and all(".lora_A.default." in n or ".lora_B.default." in n for n in adapters)
    optimized = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in adapters.values()} and len(optimized) == 28
    frozen_before = {n: p.detach().clone() for n, p in frozen.items()}
    adapters_before = {n: p.detach().clone() for n, p in adapters.items()}

    grads: dict[str, bool] = {}
    for name, param in frozen.items():  # a frozen weight never enters autograd: no hook can fire, no .grad appears
        assert not param.requires_grad, name
    for name, param in adapters.items():
        param.register_hook(lambda g, name=name: grads.__setitem__(name, True))
    for step in range(2):
        engine.train_step(batch(step), reinforce)

    assert all(p.grad is None for p in frozen.values())
    assert all(torch.equal(p, frozen_before[n]) for n, p in frozen.items()), "a frozen weight changed"
    assert sorted(grads) == sorted(adapters)
    assert all(not torch.equal(p, adapters_before[n]) for n, p in adapters.items()), "an adapter did not move"


def test_a_full_engine_still_trains_every_weight(make_engine):
    engine = make_engine(replace(TRAIN, lora=LoRAConfig()))
    names = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert len(names) == len(list(engine.model.parameters())) and not any("lora_" in n for n in names)
    assert not engine.lora


def test_a_target_that_matches_no_module_fails_in_one_line_naming_the_model_modules(make_engine, tiny_model):
    bad = replace(TRAIN, lora=replace(LORA, target_modules=["q_proj", "qkv_proj"]))
    with pytest.raises(ValueError) as error:
        make_engine(bad)
    message = str(error.value)
    assert "\n" not in message
    assert message == (
        "train.lora.target_modules: 'qkv_proj' matches no Linear module of the model (Qwen2ForCausalLM); its "
        "Linear modules are named ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', "
        "'v_proj']"
    )


def test_targets_are_checked_before_launch_from_the_model_directory_or_its_config(tiny_model):
    from transformers import AutoConfig

    assert lora_targets_problem(tiny_model, LORA.target_modules) is None
    assert lora_targets_problem(str(tiny_model), ["lm_head", "layers.1.mlp.up_proj"]) is None  # a suffix matches
    config = AutoConfig.from_pretrained(tiny_model)
    problem = lora_targets_problem(config, ["q_proj", "attn"])
    assert problem is not None and problem.startswith("train.lora.target_modules: 'attn' matches no Linear module")
    assert lora_targets_problem(config, ["proj"]) is not None, "a part of a name is not a match"


def logprobs_of(engine_or_ref, sequences):
    return torch.tensor(engine_or_ref.sequence_logprobs(sequences, 0.7))


def test_the_kl_reference_is_the_base_model_with_the_adapters_switched_off(make_engine, tiny_model):
    from transformers import AutoModelForCausalLM

    engine = make_engine()
    for step in range(2):
        engine.train_step(batch(step), reinforce)
    sequences = batch(9)
    reference = logprobs_of(BaseReference(engine), sequences)
    ids = torch.tensor([s.input_ids for s in sequences])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        logits = base(input_ids=ids).logits[:, :-1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (reference[:, 1:] - expected).abs().max() < 1e-5
    policy = logprobs_of(engine, sequences)
    assert (policy - reference).abs().max() > 1e-3, "the trained adapters must change the policy's logprobs"
    assert torch.equal(logprobs_of(engine, sequences), policy), "the adapters are back on after the reference"


def test_the_worker_takes_the_lora_reference_from_the_policy_engine(make_engine):
    from hpcrl.train.worker import _reference

    cfg = Config()
    cfg.algorithm.kl.coef = 0.1
    engine = make_engine()
    reference = _reference(cfg, engine, engine.dist)
    assert isinstance(reference, BaseReference) and reference.engine is engine
    cfg.algorithm.kl.coef = 0.0
    assert _reference(cfg, engine, engine.dist) is None


def test_the_adapter_tensors_and_config_are_peft_s(make_engine):
    from peft import get_peft_model_state_dict

    engine = make_engine()
    engine.train_step(batch(0), reinforce)
    tensors = engine.adapter_tensors()
    expected = get_peft_model_state_dict(engine.model)
    assert sorted(tensors) == sorted(expected) and len(tensors) == 28
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert all(torch.equal(tensors[k], expected[k]) and tensors[k].dtype == torch.float32 for k in tensors)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].add_(1.0)  # a copy, not the model's
    assert torch.equal(get_peft_model_state_dict(engine.model)[k := next(iter(expected))], expected[k])

    config = engine.adapter_config()
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert config["target_modules"] == sorted(LORA.target_modules) and config["inference_mode"] is True
    assert config["base_model_name_or_path"] == str(engine.model_path)


def test_the_trainer_rpc_hands_out_the_adapter_and_the_full_weight_group_refuses_it(make_engine):
    import json

    from hpcrl.rpc.wire import decode, encode
    from hpcrl.train.service import TrainerService

    engine = make_engine()
    engine.train_step(batch(0), reinforce)
    reply = TrainerService(engine, Config(), 0).handlers()["lora_adapter"](decode(encode(LoraAdapterRequest())))
    received = decode(encode(reply))  # as the controller gets it
    assert json.loads(received.config) == engine.adapter_config()
    expected = engine.adapter_tensors()
    assert sorted(received.tensors) == sorted(expected)
    assert all(torch.equal(received.tensors[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match="servers take the adapter"):
        weight_specs(engine)
    with pytest.raises(ValueError, match="servers take the adapter"):
        push_over_group(engine, None)
    with pytest.raises(ValueError, match=r"train.lora.rank=0"):
        make_engine(replace(TRAIN, lora=LoRAConfig())).adapter_tensors()
