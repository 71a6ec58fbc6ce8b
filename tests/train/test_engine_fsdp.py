"""Real torchrun, 2 ranks on CPU (gloo) against 1: FSDP2 equivalence, uneven ranks, resume, HF export, LoRA.

``scripts/fsdp_engine.py`` does the training and writes state dicts and metrics; four launches (1 rank
train, 2 ranks train, 2 ranks resume, 1 rank resume) are shared by every test here and take about a minute.
One float32 rank trains the unsharded model (``engine._shards``), so "2 ranks against 1" is FSDP2 against the
plain model.
"""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.models.tiny import make_tiny_model
from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "train" / "scripts" / "fsdp_engine.py"
TIMEOUT_S = 240  # the script's collectives time out after 120 s, so a hang fails long before this
TOLERANCE = 1e-5


def _torchrun(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    run_torchrun([*cmd, str(SCRIPT), *args], TIMEOUT_S, f"torchrun {args} on {nproc} rank(s)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    out = tmp_path_factory.mktemp("fsdp")
    _torchrun(1, str(model), str(out), "train")
    _torchrun(2, str(model), str(out), "train")
    _torchrun(2, str(model), str(out), "resume")
    _torchrun(1, str(model), str(out), "resume")
    return model, out


def _metrics(out, name, rank=0):
    return json.loads((out / f"{name}_rank{rank}.json").read_text())


def _max_abs_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("kind", ["uniform", "varying", "uneven"])
def test_two_ranks_train_like_one_process_on_the_whole_batch(runs, kind):
    model, out = runs
    single, sharded = load_file(out / f"{kind}_w1.safetensors"), load_file(out / f"{kind}_w2.safetensors")
    diff = _max_abs_diff(single, sharded)
    moved = _max_abs_diff(single, load_file(model / "model.safetensors") | {"lm_head.weight": single["lm_head.weight"]})
    print(f"{kind}: max |w1 - w2| = {diff:.3g} after training moved weights by up to {moved:.3g}")
    assert diff < TOLERANCE
    assert moved > 10 * TOLERANCE, "training barely moved the weights, so equality would prove little"

    one, two = _metrics(out, f"{kind}_w1"), _metrics(out, f"{kind}_w2")
    for a, b in zip(one, two, strict=True):
        # grad_norm would differ by the world size if FSDP's mean over ranks were left in place
        for key in ("loss", "grad_norm", "lr", "tokens", "loss_tokens", "sequences"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def _base_name(peft_name: str) -> str:
    """The model directory's name of a weight of the peft model (``base_model.model.`` and ``.base_layer`` off)."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def test_two_ranks_train_the_lora_adapters_like_one_process_and_leave_the_base_alone(runs):
    model, out = runs
    single, sharded = load_file(out / "lora_w1.safetensors"), load_file(out / "lora_w2.safetensors")
    assert len(single) == 28 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in single)
    diff = _max_abs_diff(single, sharded)
    moved = max(float(v.abs().max()) for k, v in single.items() if ".lora_B." in k)  # lora_B starts at zero
    print(f"lora: max |w1 - w2| = {diff:.3g} after training moved lora_B up to {moved:.3g}")
    assert diff < TOLERANCE and moved > 10 * TOLERANCE
    for a, b in zip(_metrics(out, "lora_w1"), _metrics(out, "lora_w2"), strict=True):
        for key in ("loss", "grad_norm", "lr", "tokens", "loss_tokens", "sequences"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key

    initial = load_file(model / "model.safetensors")
    for world in (1, 2):
        full = load_file(out / f"lora_w{world}_full.safetensors")
        base = {_base_name(k): v for k, v in full.items() if ".lora_" not in k and not k.endswith("lm_head.weight")}
        assert base.keys() == initial.keys() and all(torch.equal(base[k], initial[k]) for k in initial)
        for rank in range(world):
            assert all(row["frozen_grads_none"] for row in _metrics(out, f"lora_w{world}", rank))


def test_the_lora_kl_reference_is_the_base_model_on_two_ranks_and_on_one(runs):
    _, out = runs
    for world in (1, 2):
        for rank in range(world):
            check = json.loads((out / f"lora_reference_w{world}_rank{rank}.json").read_text())
            assert check["max_abs_diff"] < TOLERANCE, (world, rank, check)
            assert check["policy_moved"] > 100 * TOLERANCE, "the trained policy must differ from its reference"


def test_a_two_rank_lora_checkpoint_resumes_on_two_ranks_and_on_one(runs):
    _, out = runs
    before = _metrics(out, "lora_step6_before")
    assert _metrics(out, "lora_step6_after_w2") == before  # loss, grad_norm, lr, step: exactly
    adapter = load_file(out / "lora_step6_before.safetensors")
    after = load_file(out / "lora_step6_after_w2.safetensors")
    assert adapter.keys() == after.keys() and all(torch.equal(adapter[k], after[k]) for k in adapter)
    for a, b in zip(before, _metrics(out, "lora_step6_after_w1"), strict=True):
        for key in ("loss", "grad_norm", "lr", "tokens", "step"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert _max_abs_diff(adapter, load_file(out / "lora_step6_after_w1.safetensors")) < TOLERANCE


def test_ranks_agree_on_the_micro_batch_count(runs):
    _, out = runs
    for kind in ("uniform", "varying", "uneven"):
        rank0, rank1 = _metrics(out, f"{kind}_w2", 0), _metrics(out, f"{kind}_w2", 1)
        for a, b in zip(rank0, rank1, strict=True):
            assert a["microbatches"] == b["microbatches"] >= max(a["local_packed"], b["local_packed"])
            assert a["loss"] == b["loss"], "train_step reports global metrics, the same on every rank"
    # the varying batches make one rank split micro-batches in some step ...
    varying = zip(_metrics(out, "varying_w2", 0), _metrics(out, "varying_w2", 1), strict=True)
    assert any(a["local_packed"] != b["local_packed"] for a, b in varying)
    # ... and in the uneven one rank 1 (one short sequence) runs 11 empty micro-batches beside rank 0's 12
    (uneven0,), (uneven1,) = _metrics(out, "uneven_w2", 0), _metrics(out, "uneven_w2", 1)
    assert (uneven0["local_packed"], uneven1["local_packed"], uneven1["microbatches"]) == (12, 1, 12)


def test_resume_from_the_sharded_checkpoint_is_bit_identical(runs):
    _, out = runs
    before, after = _metrics(out, "step6_before"), _metrics(out, "step6_after_w2")
    assert after == before  # loss, grad_norm, lr, step: exactly
    assert before[0]["step"] == 6
    a, b = load_file(out / "step6_before.safetensors"), load_file(out / "step6_after_w2.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_sharded_checkpoint_resumes_on_one_unsharded_rank(runs):
    # one float32 rank trains the plain model (no FSDP2): the two ranks' DCP shards load into its whole tensors
    model, out = runs
    before, after = _metrics(out, "step6_before"), _metrics(out, "step6_after_w1")
    for a, b in zip(before, after, strict=True):
        assert b["step"] == a["step"] == 6
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    a, b = load_file(out / "step6_before.safetensors"), load_file(out / "step6_after_w1.safetensors")
    assert _max_abs_diff(a, b) < TOLERANCE
    initial = load_file(model / "model.safetensors") | {"lm_head.weight": a["lm_head.weight"]}
    assert _max_abs_diff(a, initial) > 10 * TOLERANCE, "the checkpoint holds trained weights, not the initial"


def test_the_full_state_dict_gathered_in_one_collective_is_torchs_bit_for_bit(runs):
    _, out = runs
    result = json.loads((out / "gather.json").read_text())
    assert result["same"], result
    assert "model.embed_tokens.weight" in result["uneven"], "a tensor whose rows split unevenly over the ranks"


def test_export_hf_loads_with_from_pretrained_and_holds_the_trained_weights(runs):
    from transformers import AutoModelForCausalLM

    from hpcrl.models.tokenizer import load_tokenizer

    model, out = runs
    exported = AutoModelForCausalLM.from_pretrained(out / "export")
    trained = load_file(out / "varying_w2.safetensors")
    state = exported.state_dict()
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert load_tokenizer(out / "export")("a+b=")["input_ids"] == load_tokenizer(model)("a+b=")["input_ids"]


def test_sharded_token_logprobs_match_the_plain_model(runs):
    _, out = runs
    for rank in (0, 1):
        check = json.loads((out / f"logprobs_check_rank{rank}.json").read_text())
        print(f"rank {rank}: max |sharded - plain| logprob = {check['max_abs_diff']:.3g}")
        assert check["max_abs_diff"] < TOLERANCE
