"""LoRA on the policy in this process (1 rank, unsharded): what trains, the targets' check, the KL reference, the
adapter's tensors and config, and what a LoRA run writes: checkpoints (the adapter and its optimizer state only),
exports (PEFT's layout, and the merged model with export.merged) and the servers' disk sync directory. Two FSDP2
ranks: test_engine_fsdp.py."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.config.schema import Config, LoRAConfig, TrainConfig
from hpcrl.rpc.messages import ExportWeights
from hpcrl.train.batch import Sequence
from hpcrl.train.checkpoint import STATE_FILE, checkpoint_lora_problem, load_checkpoint, save_checkpoint
from hpcrl.train.engine import Engine
from hpcrl.train.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraAdapterRequest, lora_targets_problem
from hpcrl.train.lora_reference import BaseReference
from hpcrl.train.weight_push import push_over_group, push_to_disk, weight_specs

LORA = LoRAConfig(rank=4, alpha=8.0)
TRAIN = TrainConfig(lr=1e-2, weight_decay=0.01, micro_batch_tokens=64, lora=LORA)


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


def test_the_adapters_start_the_same_whatever_the_process_drew_before(make_engine):
    # every FSDP2 rank shards its own copy of the model: adapters drawn apart would be pieces of different adapters
    torch.manual_seed(1)
    first = make_engine().adapter_tensors()
    torch.manual_seed(2)
    torch.rand(5)
    state = torch.random.get_rng_state()
    second = make_engine().adapter_tensors()
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's random state is left as it was"
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert any(v.abs().sum() > 0 for k, v in first.items() if ".lora_A." in k)


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


TOKENIZER_FILES = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]


def _bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _trained(make_engine, steps: int = 2, train=TRAIN) -> Engine:
    engine = make_engine(train)
    for step in range(steps):
        engine.train_step(batch(step), reinforce)
    return engine


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A model whose base weights, not the per-tensor overhead of DCP's files, make up a full checkpoint."""
    from hpcrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("wide"), hidden_size=256, intermediate_size=1024)


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_only(wide_model, dist_info, tmp_path):
    import torch.distributed.checkpoint as dcp

    def saved(train, name):
        engine = Engine(wide_model, train, dist=dist_info)
        engine.setup()
        engine.train_step(batch(0), reinforce)
        return engine, save_checkpoint(engine, tmp_path / name)

    engine, lora = saved(TRAIN, "lora")
    _, full = saved(replace(TRAIN, lora=LoRAConfig()), "full")
    ratio = _bytes(lora) / _bytes(full)
    print(f"LoRA checkpoint {_bytes(lora)} bytes, full {_bytes(full)} bytes: {ratio:.3f}")
    assert ratio < 0.05

    metadata = dcp.FileSystemReader(lora).read_metadata().state_dict_metadata
    adapters = {n: p for n, p in engine.model.named_parameters() if p.requires_grad}
    assert sorted(k for k in metadata if k.startswith("model.")) == sorted(f"model.{n}" for n in adapters)
    moments = [k for k in metadata if k.startswith("optim.state.")]
    assert len(moments) == 3 * 28 and all(".lora_" in k for k in moments)  # step, exp_avg, exp_avg_sq per adapter
    record = json.loads((lora / STATE_FILE).read_text())["lora"]
    assert record == {"rank": 4, "alpha": 8.0, "target_modules": sorted(TRAIN.lora.target_modules)}


def test_a_lora_checkpoint_resumes_exactly(make_engine, tmp_path):
    engine = _trained(make_engine, steps=3)
    path = save_checkpoint(engine, tmp_path / "ckpt")
    expected = engine.train_step(batch(3), reinforce)
    expected_state = engine.full_state_dict()

    resumed = make_engine()
    before = resumed.full_state_dict()
    load_checkpoint(resumed, path)
    assert resumed.step == 3
    got = resumed.train_step(batch(3), reinforce)
    assert got == expected  # loss, grad norm, lr and step, exactly
    state = resumed.full_state_dict()
    assert all(torch.equal(state[name], expected_state[name]) for name in expected_state)
    # the base it resumed on is the model directory's, which the loaded checkpoint did not touch
    assert all(torch.equal(state[n], before[n]) for n in before if "lora_" not in n)


@pytest.mark.parametrize("saved_lora", [True, False])
def test_a_checkpoint_loads_only_into_a_run_of_the_same_kind(make_engine, tmp_path, saved_lora):
    full = replace(TRAIN, lora=LoRAConfig())
    path = save_checkpoint(make_engine(TRAIN if saved_lora else full), tmp_path / "ckpt")
    with pytest.raises(ValueError) as error:
        load_checkpoint(make_engine(full if saved_lora else TRAIN), path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"checkpoint {path}: it holds ")
    if saved_lora:
        assert "a LoRA adapter (rank 4, alpha 8," in message and "this run trains full weights" in message
    else:
        assert "full weights and no LoRA adapter" in message and "resume with train.lora.rank=0" in message
    # the same line before launch, from the state file alone
    assert checkpoint_lora_problem(path, (full if saved_lora else TRAIN).lora) == message.split(": ", 1)[1]
    assert checkpoint_lora_problem(path, (TRAIN if saved_lora else full).lora) is None
    other_rank = replace(TRAIN, lora=replace(TRAIN.lora, rank=8))
    if saved_lora:
        with pytest.raises(ValueError, match=r"its LoRA adapter is rank 4, .* this run's train.lora is rank 8"):
            load_checkpoint(make_engine(other_rank), path)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_export_is_the_adapter_in_peft_layout_and_the_merged_model(make_engine, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpcrl.train.service import TrainerService

    engine = _trained(make_engine)
    cfg = Config()
    cfg.export.merged = True
    TrainerService(engine, cfg, 0).handlers()["export_weights"](ExportWeights(str(tmp_path / "final")))
    out = tmp_path / "final"
    # the adapter beside the base's tokenizer files (the tiny model's), no base weights or config
    expected_files = [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "merged", *TOKENIZER_FILES]
    assert sorted(p.name for p in out.iterdir()) == sorted(expected_files)
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert json.loads((out / ADAPTER_CONFIG).read_text()) == engine.adapter_config()

    ids = torch.tensor([s.input_ids for s in batch(7)])
    engine.model.eval()
    expected = _logits(engine.model, ids)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out)
    assert torch.equal(_logits(adapted, ids), expected)
    base = _logits(AutoModelForCausalLM.from_pretrained(tiny_model), ids)
    assert (base - expected).abs().max() > 1e-3, "the trained adapter must change the logits"

    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not any("lora" in k or "base_layer" in k or k.startswith("base_model.") for k in merged.state_dict())
    assert (_logits(merged, ids) - expected).abs().max() < 1e-4
    assert {"config.json", "model.safetensors", *TOKENIZER_FILES} <= {p.name for p in (out / "merged").iterdir()}


def test_without_export_merged_there_is_no_merged_model(make_engine, tmp_path):
    engine = make_engine()
    out = engine.export_hf(tmp_path / "final")
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, *TOKENIZER_FILES} <= {p.name for p in out.iterdir()}
    assert not (out / "merged").exists()
    with pytest.raises(ValueError, match=r"export\.merged applies to LoRA only"):
        make_engine(replace(TRAIN, lora=LoRAConfig())).export_hf(tmp_path / "full", merged=True)


def test_the_disk_sync_writes_the_adapter_alone_for_load_lora_adapter(make_engine, tmp_path):
    engine = _trained(make_engine)
    out = push_to_disk(engine, tmp_path / "weights" / "step_2")
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]  # no added_tokens.json
    written = load_file(out / ADAPTER_WEIGHTS)
    expected = engine.adapter_tensors()
    assert sorted(written) == sorted(expected) and all(torch.equal(written[k], expected[k]) for k in expected)
    assert json.loads((out / ADAPTER_CONFIG).read_text()) == engine.adapter_config()
