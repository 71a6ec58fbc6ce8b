"""LoRA on hpcrl's CPU server as a real process over real HTTP, against PEFT's own reference, with SGLang 0.5.23's
flags, routes, answers and refusals (``hpcrl/inference/server/lora.py``)."""

import base64
import json
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hpcrl.inference.server.__main__ import parse_args
from hpcrl.inference.server.tensor_payload import encode_named_tensors
from tests.inference.conftest import ServerProc

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]  # the server's; gate_proj/up_proj left out
PROMPT = [10, 11, 12, 13, 14]


def _make_adapter(base_dir, out_dir, seed: int, r: int, targets: list[str]):
    """A PEFT adapter with nonzero B (``init_lora_weights=False``), so it changes what the model says."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": _make_adapter(tiny_model, root / "a", 1, 4, ["q_proj", "v_proj", "down_proj"]),
        "b": _make_adapter(tiny_model, root / "b", 2, 2, ["k_proj", "o_proj"]),
        "wide": _make_adapter(tiny_model, root / "wide", 3, 16, ["q_proj"]),
        "up": _make_adapter(tiny_model, root / "up", 4, 2, ["up_proj"]),
    }


@pytest.fixture(scope="module")
def lora_server(tiny_model, adapters, tmp_path_factory):
    """Adapter ``a`` loaded at start (``--lora-paths``); others load through the routes."""
    flags = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS]
    flags += ["--lora-paths", f"a={adapters['a']}", "--max-loras-per-batch", "3"]
    proc = ServerProc(tiny_model, tmp_path_factory.mktemp("lora-server") / "server.log", "127.0.0.1", *flags)
    yield proc
    proc.stop()


def _reference(tiny_model, adapter_dir=None):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def _logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """The temperature-1 logprobs ``model`` gives ``output`` after ``prompt`` (one forward)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def _greedy(prompt=PROMPT, **extra):
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


def _check_against(model, answer, prompt=PROMPT):
    """The answer is the greedy completion of ``model`` and carries its logprobs (the server-test tolerance)."""
    got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(_logprobs(model, prompt, answer["output_ids"]), abs=1e-4)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer["output_ids"]])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == answer["output_ids"]


def _load_from_tensors(server, name, adapter_dir, plain=False, **extra):
    """SGLang's payload: ``ForkingPickler`` (shared memory, this host) or, ``plain``, a pickle holding the bytes."""
    config = json.loads(Path(adapter_dir, "adapter_config.json").read_text())
    tensors = load_file(f"{adapter_dir}/adapter_model.safetensors")
    payload = base64.b64encode(pickle.dumps(tensors, protocol=4)).decode() if plain else encode_named_tensors(tensors)
    body = {"lora_name": name, "config_dict": config, "serialized_named_tensors": [payload]}
    return server.post("/load_lora_adapter_from_tensors", {**body, **extra})


def test_generation_through_adapters_equals_peft_in_one_mixed_batch(lora_server, tiny_model, adapters):
    """``a`` (from --lora-paths), ``b`` (from tensors) and the base in one batch, one prompt for all three (a
    shared prefill would hand the base's cache to the adapters), and ``n=2`` of a list of adapters."""
    status, out = _load_from_tensors(lora_server, "b", adapters["b"])
    assert (status, out["success"], out["error_message"]) == (200, True, "")
    assert out["loaded_adapters"] == {"a": adapters["a"], "b": "__tensor__"}
    body = {**_greedy(), "input_ids": [PROMPT] * 3, "lora_path": ["a", None, "b"], "return_logprob": True}
    status, answers = lora_server.post("/generate", body)
    assert status == 200, answers
    ref_a, ref_b, base = (
        _reference(tiny_model, adapters["a"]),
        _reference(tiny_model, adapters["b"]),
        _reference(tiny_model),
    )
    for model, answer in zip([ref_a, base, ref_b], answers, strict=True):
        _check_against(model, answer)
    assert (
        answers[0]["output_ids"] != answers[1]["output_ids"]
        or answers[0]["meta_info"]["output_token_logprobs"] != answers[1]["meta_info"]["output_token_logprobs"]
    )
    assert _logprobs(base, PROMPT, answers[0]["output_ids"]) != pytest.approx(
        _logprobs(ref_a, PROMPT, answers[0]["output_ids"]), abs=1e-2
    )
    assert _logprobs(base, PROMPT, answers[2]["output_ids"]) != pytest.approx(
        _logprobs(ref_b, PROMPT, answers[2]["output_ids"]), abs=1e-2
    )
    # n=2: the list names each prompt's adapter, repeated for every sample (GenerateReqInput._normalize_lora_paths)
    body = {"input_ids": [PROMPT, PROMPT[:3]], "lora_path": ["b", "a"], "return_logprob": True}
    body["sampling_params"] = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "n": 2}
    status, answers = lora_server.post("/generate", body)
    assert status == 200 and len(answers) == 4
    for model, prompt, answer in zip(
        [ref_b, ref_b, ref_a, ref_a], [PROMPT, PROMPT, PROMPT[:3], PROMPT[:3]], answers, strict=True
    ):
        _check_against(model, answer, prompt)


def test_openai_model_names_an_adapter(lora_server, tiny_model, adapters):
    """SGLang's ``<served model>:<adapter>`` on the OpenAI routes."""
    body = {"model": f"{tiny_model}:a", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, out = lora_server.post("/v1/completions", body)
    assert status == 200, out
    status, plain = lora_server.post("/generate", {**_greedy(), "lora_path": "a"})
    assert out["choices"][0]["text"] == plain["text"]
    status, listing = lora_server.get("/v1/models")
    cards = {card["id"]: (card["root"], card["parent"]) for card in listing["data"]}
    assert cards[str(tiny_model)] == (str(tiny_model), None) and cards["a"] == (adapters["a"], str(tiny_model))
    status, out = lora_server.post("/v1/completions", {**body, "model": f"{tiny_model}:nope"})
    assert status == 400 and out["message"].startswith("Got LoRA adapter that has never been loaded: nope\n")


def test_refusals_are_sglangs(lora_server, adapters):
    status, out = lora_server.post("/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"]})
    assert status == 400 and out["error_message"] == "Failed to load LoRA adapter a because it is already loaded"
    assert out["loaded_adapters"]["a"] == adapters["a"] and out["success"] is False
    for name in ("wide", "up"):  # rank 16 > 8; up_proj (gate_up_proj) outside the targets
        status, out = lora_server.post("/load_lora_adapter", {"lora_name": name, "lora_path": adapters[name]})
        assert status == 400 and out["error_message"].startswith(
            f"LoRA adapter {name} with rank {16 if name == 'wide' else 2} is incompatible with the current LoRA memory"
        ), out
    status, out = lora_server.post("/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 400 and out["error_message"].startswith(
        "LoRA with name nope does not exist. Loaded LoRAs: odict_keys(["
    )
    assert out["loaded_adapters"] is None
    status, out = lora_server.post("/generate", {**_greedy(), "lora_path": "nope"})
    assert status == 400 and out["error"]["message"].startswith("Got LoRA adapter that has never been loaded: nope\n")
    status, out = lora_server.post("/generate", {**_greedy(), "input_ids": [PROMPT] * 2, "lora_path": ["a"]})
    assert status == 400 and out["error"]["message"] == "lora_path list length (1) must match batch size (2)"
    status, _ = lora_server.post("/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["a"], "oops": 1})
    assert status == 400


def test_unload_waits_for_the_requests_using_the_adapter_and_a_later_request_reloads_it(
    lora_server, tiny_model, adapters
):
    status, _ = lora_server.post("/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["a"]})
    assert status == 200
    long = {
        "input_ids": PROMPT,
        "lora_path": "c",
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0},
    }
    done = {}

    def generate():
        done["answer"] = lora_server.post("/generate", {**long, "return_logprob": True})[1]
        done["at"] = time.monotonic()

    runner = threading.Thread(target=generate)
    runner.start()
    time.sleep(0.3)
    status, out = lora_server.post("/unload_lora_adapter", {"lora_name": "c"})
    unloaded_at = time.monotonic()
    runner.join(60)
    assert status == 200 and out["success"] and "c" not in out["loaded_adapters"]
    assert done["at"] <= unloaded_at, "the unload answered before the request using the adapter finished"
    assert done["answer"]["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    ref = _reference(tiny_model, adapters["a"])
    lp = [x for x, _, _ in done["answer"]["meta_info"]["output_token_logprobs"]]
    assert lp == pytest.approx(_logprobs(ref, PROMPT, done["answer"]["output_ids"]), abs=1e-4)
    # SGLang reloads an unloaded adapter from its path when a request names it again
    status, answer = lora_server.post("/generate", {**_greedy(), "lora_path": "c", "return_logprob": True})
    assert status == 200
    _check_against(ref, answer)
    # ...which an adapter loaded from tensors has not
    assert _load_from_tensors(lora_server, "t", adapters["b"])[0] == 200
    assert lora_server.post("/unload_lora_adapter", {"lora_name": "t"})[0] == 200
    status, out = lora_server.post("/generate", {**_greedy(), "lora_path": "t"})
    assert status == 400 and out["error"]["message"].startswith("Failed to implicitly load LoRA adapter t: ")


def test_lora_off_refuses_its_routes_and_lora_path(server):
    for path, body in [
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
        ("/unload_lora_adapter", {"lora_name": "a"}),
        ("/load_lora_adapter_from_tensors", {"lora_name": "a", "config_dict": {}, "serialized_named_tensors": []}),
    ]:
        status, out = server.post(path, body)
        assert (status, out["error_message"]) == (
            400,
            "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
        )
    status, out = server.post("/generate", {**_greedy(), "lora_path": "a"})
    assert status == 400 and out["error"]["message"].startswith(
        "LoRA adapter 'a' was requested, but LoRA is not enabled."
    )


def test_launch_flags_as_sglang_checks_them(capsys, tmp_path, adapters):
    base = ["--model-path", str(tmp_path), "--port", "1"]
    cases = [
        (
            ["--enable-lora", "--max-lora-rank", "8"],
            "When no initial --lora-paths is provided, you need to specify both",
        ),
        (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"], "If 'all' is specified"),
        (["--enable-lora", "--max-loras-per-batch", "0"], "max_loras_per_batch must be positive"),
        (["--lora-paths", f"a={adapters['a']}", "--tp-size", "2"], "applies adapters on tp rank 0 only"),
        (["--max-lora-rank", "8"], "need --enable-lora"),
        (
            ["--lora-paths", f"b={adapters['b']}", "--lora-target-modules", "q_proj"],
            "LoRA adapter 'b' contains target modules ['o_proj'] that are not included",
        ),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit):
            parse_args(base + flags)
        assert message in capsys.readouterr().err, flags
    json_spec = json.dumps({"lora_name": "j", "lora_path": adapters["b"], "pinned": True})
    lora = parse_args([*base, "--lora-paths", f"a={adapters['a']}", adapters["b"], json_spec]).lora
    assert lora.enabled and lora.max_rank == 4  # inferred: the largest rank of --lora-paths
    assert lora.targets == {"qkv_proj", "o_proj", "down_proj"}
    assert lora.initial == (
        ("a", adapters["a"], False),
        (adapters["b"], adapters["b"], False),
        ("j", adapters["b"], True),
    )


def test_a_batch_holds_at_most_max_loras_per_batch_adapters_the_base_counting():
    """SGLang's scheduler skips a request whose adapter would be one too many; those behind it that fit go first."""
    from hpcrl.inference.server.sampling import SamplingParams
    from hpcrl.inference.server.scheduler import Scheduler, Sequence

    scheduler = Scheduler(runner=None)
    scheduler.max_loras_per_batch = 2
    loras = ["x", None, "y", "x", "z", None]
    scheduler.waiting.extend(Sequence(f"r{i}", [1], SamplingParams(), None, lora=a) for i, a in enumerate(loras))
    assert [s.rid for s in scheduler._take(10, set())] == ["r0", "r1", "r3", "r5"]
    assert [s.rid for s in scheduler.waiting] == ["r2", "r4"]
    assert [s.rid for s in scheduler._take(10, {"v", "w"})] == []  # a running batch already holds two
    assert [s.rid for s in scheduler._take(1, set())] == ["r2"]


def test_weight_names_stay_hugging_faces_with_adapters_in_the_model(tiny_model, adapters):
    """PEFT wraps a targeted layer (``q_proj.base_layer.weight``); weight updates still name ``q_proj.weight``."""
    from hpcrl.inference.server import lora_model
    from hpcrl.inference.server.runner import ModelRunner

    runner = ModelRunner(str(tiny_model))
    before = {k: v.clone() for k, v in runner.parameter_specs().items()}
    config = lora_model.peft_config(json.loads(Path(adapters["a"], "adapter_config.json").read_text()))
    lora_model.add_adapter(runner, "id1", config, lora_model.read_adapter_tensors(adapters["a"]))
    assert runner.adapter_layers and runner.parameter_specs().keys() == before.keys()
    runner.load_tensors(
        {"model.layers.0.self_attn.q_proj.weight": before["model.layers.0.self_attn.q_proj.weight"] + 1}
    )
    assert torch.equal(
        runner.parameter_specs()["model.layers.0.self_attn.q_proj.weight"],
        before["model.layers.0.self_attn.q_proj.weight"] + 1,
    )
    lora_model.remove_adapter(runner, "id1")
    assert not any(".lora_" in k for k in runner.model.state_dict())


def test_elastic_resume_an_adapter_trained_with_dropout_generates_without_it(tiny_model, adapters):
    """A trainer's adapter keeps its ``lora_dropout`` in adapter_config.json; SGLang applies none, and neither does the
    server: its logits are the same every time (they were random, so a LoRA run with dropout never repeated)."""
    from hpcrl.inference.server import lora_model
    from hpcrl.inference.server.runner import ModelRunner

    runner = ModelRunner(str(tiny_model))
    saved = json.loads(Path(adapters["a"], "adapter_config.json").read_text())
    config = lora_model.peft_config({**saved, "lora_dropout": 0.5})
    lora_model.add_adapter(runner, "id1", config, lora_model.read_adapter_tensors(adapters["a"]))
    assert not [name for name, module in runner.model.named_modules() if module.training]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        first, again = (runner.model(input_ids=ids).logits for _ in range(2))
    assert torch.equal(first, again)


def test_update_weight_version_sets_what_requests_report(lora_server):
    """SGLang's ``/update_weight_version``, which a LoRA push sends after the load (a load changes no version)."""
    status, out = lora_server.post("/update_weight_version", {"new_version": "7", "abort_all_requests": False})
    assert (status, out) == (200, {"success": True, "message": "Weight version updated to 7", "new_version": "7"})
    status, answer = lora_server.post("/generate", {**_greedy(), "lora_path": "a"})
    assert status == 200 and answer["meta_info"]["weight_version"] == "7"
    assert lora_server.post("/update_weight_version", {})[0] == 400  # new_version is required


def test_a_request_arriving_while_paused_gets_the_adapter_loaded_before_continue(lora_server, tiny_model, adapters):
    """A LoRA push (pause, unload, load under the same name, continue): SGLang's request waits out the pause before
    looking its adapter up, so it runs on the new adapter, and the unload does not wait for it."""
    assert lora_server.post("/load_lora_adapter", {"lora_name": "swap", "lora_path": adapters["a"]})[0] == 200
    assert lora_server.post("/pause_generation", {"mode": "abort"})[0] == 200
    done = {}
    body = {**_greedy(), "lora_path": "swap", "return_logprob": True}
    arriving = threading.Thread(target=lambda: done.update(answer=lora_server.post("/generate", body)))
    arriving.start()
    time.sleep(0.3)
    try:
        assert lora_server.post("/unload_lora_adapter", {"lora_name": "swap"}, timeout=10)[0] == 200
        assert _load_from_tensors(lora_server, "swap", adapters["b"], plain=True)[0] == 200
    finally:
        lora_server.post("/continue_generation", {})
    arriving.join(60)
    status, answer = done["answer"]
    assert status == 200
    _check_against(_reference(tiny_model, adapters["b"]), answer)
