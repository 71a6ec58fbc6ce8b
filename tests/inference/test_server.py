"""hpcrl's CPU server as a real process over real HTTP, checked against in-process transformers."""

import re
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpcrl.inference.weight_group import close_weight_group, host_store, open_weight_group, send_tensors
from hpcrl.models.tokenizer import load_tokenizer

LONG = 6000  # new tokens no server here can produce in the second before a test interrupts them
PROMPTS = ["3+4=", "12+7=", "hello", "9+9=", "a", "0+0=", "The cat", "5+"]


def _reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), load_tokenizer(model_dir)


def _greedy_ids(model, tok, prompt, max_new_tokens):
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    return new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new


def _greedy_body(tok, prompt, max_new_tokens=12):
    ids = tok(prompt)["input_ids"]
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True}


def test_greedy_matches_in_process_generate_and_logprobs_match_a_forward_pass(server, tiny_model):
    model, tok = _reference(tiny_model)
    answers = server.generate_many([_greedy_body(tok, p) for p in PROMPTS])
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer["output_ids"] == _greedy_ids(model, tok, prompt, 12), prompt
        prompt_ids = tok(prompt)["input_ids"]
        full = torch.tensor([prompt_ids + answer["output_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(full).logits[0, :-1].float(), dim=-1)
        expected = [logprobs[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(answer["output_ids"])]
        got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(expected, abs=1e-4)
        assert [t for _, t, _ in answer["meta_info"]["output_token_logprobs"]] == answer["output_ids"]


def test_sampled_logprobs_are_of_the_tempered_distribution(server, tiny_model):
    model, tok = _reference(tiny_model)
    prompt_ids = tok("3+4=")["input_ids"]
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True}}
    status, answer = server.post("/generate", {**body, "return_logprob": True})
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    full = torch.tensor([prompt_ids + answer["output_ids"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(full).logits[0, :-1].float() / 0.7, dim=-1)
    expected = [logprobs[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(answer["output_ids"])]
    assert [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]] == pytest.approx(expected, abs=1e-4)


def test_text_batch_and_n_samples(server):
    status, answers = server.post(
        "/generate", {"text": ["1+1=", "2+2="], "sampling_params": {"max_new_tokens": 3, "n": 3, "ignore_eos": True}}
    )
    assert status == 200 and len(answers) == 6
    assert all(len(a["output_ids"]) == 3 and "output_token_logprobs" not in a["meta_info"] for a in answers)
    ids = [a["meta_info"]["id"] for a in answers]
    assert len(set(ids)) == 6 and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids), "SGLang gives n > 1 fresh rids"


def test_stop_token_ids_end_generation_with_stop(server, tiny_model):
    model, tok = _reference(tiny_model)
    first = _greedy_ids(model, tok, "3+4=", 1)[0]
    body = {"text": "3+4=", "sampling_params": {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [first]}}
    status, answer = server.post("/generate", body)
    assert status == 200
    assert answer["output_ids"] == [first]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1, 2], "text": "x"}, "exactly one of text and input_ids"),
        ({"input_ids": []}, "non-empty list"),
        ({"input_ids": [1, 500]}, "input_ids[1]=500 is not a token id"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature must be"),
        ({"input_ids": [1], "sampling_params": {"min_p": 0.1}}, "unsupported field(s) ['min_p']"),
        ({"input_ids": [1], "stream": True}, "stream=true is not supported"),
        ({"input_ids": [1], "bogus": 1}, "unsupported field(s) ['bogus']"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, body, message):
    status, answer = server.post("/generate", body)
    assert status == 400 and message in answer["error"]["message"]


def test_update_weights_from_disk_changes_outputs_and_version(fresh_server, tiny_model_b):
    server = fresh_server
    model_b, tok = _reference(tiny_model_b)
    status, reply = server.post("/update_weights_from_disk", {"model_path": str(tiny_model_b), "weight_version": "7"})
    assert status == 200 and reply["success"], reply
    answers = server.generate_many([_greedy_body(tok, p) for p in PROMPTS[:4]])
    for prompt, answer in zip(PROMPTS[:4], answers, strict=True):
        assert answer["output_ids"] == _greedy_ids(model_b, tok, prompt, 12)
        assert answer["meta_info"]["weight_version"] == "7"
    assert server.get("/model_info")[1]["weight_version"] == "7"
    status, reply = server.post("/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert status == 400 and not reply["success"] and "/nonexistent" in reply["message"]


def test_update_weights_over_a_gloo_group(fresh_server, tiny_model_b):
    server = fresh_server
    from tests.inference.conftest import free_port

    model_b, tok = _reference(tiny_model_b)
    port = free_port()
    joined = {}
    store = host_store("127.0.0.1", port, timeout_s=60)  # the trainer listens first, on its own node
    trainer = threading.Thread(
        target=lambda: joined.update(group=open_weight_group("127.0.0.1", port, 0, 2, timeout_s=60, store=store))
    )
    trainer.start()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    status, reply = server.post("/init_weights_update_group", body)
    trainer.join(60)
    assert status == 200 and reply["success"] and "group" in joined
    params = {k: v for k, v in model_b.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    names = list(params)
    update = {
        "names": names,
        "dtypes": [str(params[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(params[n].shape) for n in names],
        "weight_version": "3",
    }
    assert server.post("/begin_weight_update", {})[0] == 200
    result = {}
    request = threading.Thread(target=lambda: result.update(r=server.post("/update_weights_from_distributed", update)))
    request.start()
    send_tensors(joined["group"], [params[n] for n in names])
    request.join(60)
    assert result["r"][0] == 200 and result["r"][1]["success"], result
    assert result["r"][1]["message"] == "Succeeded to update parameter online. Weight version updated to 3."
    assert server.post("/end_weight_update", {})[0] == 200
    answers = server.generate_many([_greedy_body(tok, p) for p in PROMPTS[:4]])
    for prompt, answer in zip(PROMPTS[:4], answers, strict=True):
        assert answer["output_ids"] == _greedy_ids(model_b, tok, prompt, 12)
        assert answer["meta_info"]["weight_version"] == "3"
    assert server.post("/destroy_weights_update_group", {"group_name": "weight_update_group"})[0] == 200
    close_weight_group(joined["group"])  # this process's torch knows the group by name until it is destroyed


def test_pause_abort_ends_in_flight_requests_and_continue_resumes(long_server):
    server = long_server
    long = {"text": "1+1=", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    results = []
    threads = [threading.Thread(target=lambda: results.append(server.post("/generate", long))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert server.post("/pause_generation", {"mode": "abort"})[0] == 200
    for t in threads:
        t.join(60)
    assert len(results) == 4
    for status, answer in results:
        assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(answer["output_ids"]) < LONG
    assert server.post("/continue_generation")[0] == 200
    status, answer = server.post(
        "/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    )
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_holds_requests_until_continue(long_server):
    server = long_server
    body = {"text": "1+1=", "sampling_params": {"max_new_tokens": 2500, "ignore_eos": True}}
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=server.post("/generate", body)))
    thread.start()
    time.sleep(0.5)
    server.post("/pause_generation", {"mode": "in_place"})
    time.sleep(1.0)
    assert thread.is_alive(), "an in-place pause must hold the request, not end it"
    server.post("/continue_generation")
    thread.join(300)  # 2500 tokens take seconds alone, much longer on a loaded machine
    assert not thread.is_alive(), "the request did not finish within 300 s of the continue"
    status, answer = result["r"]
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 2500}


def test_abort_request_by_rid(long_server):
    server = long_server
    body = {"text": "1+1=", "rid": "victim", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=server.post("/generate", body)))
    thread.start()
    time.sleep(0.5)
    assert server.post("/abort_request", {"rid": "victim"})[0] == 200
    thread.join(60)
    assert result["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["r"][1]["meta_info"]["id"] == "victim"


def test_health_model_info_and_flush(server, tiny_model):
    assert server.get("/health")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        status, info = server.get(path)
        assert status == 200 and info["model_path"] == str(tiny_model) and info["is_generation"]
    assert server.post("/flush_cache")[0] == 200


def test_requests_joining_a_running_batch_decode_exactly(long_server):
    """Continuous batching: rows that join mid-batch (KV cache padded and merged) give the same tokens."""
    server = long_server
    model, tok = _reference(server.model)
    long = {"text": "1+1=", "rid": "runner", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    result = {}
    runner = threading.Thread(target=lambda: result.update(r=server.post("/generate", long)))
    runner.start()
    time.sleep(0.3)
    joiners = ["7+8=", "The quick brown fox", "42", "x"]
    answers = server.generate_many([_greedy_body(tok, p, 20) for p in joiners])
    assert runner.is_alive(), "the long request must still run, so the joiners were merged into its batch"
    server.post("/abort_request", {"rid": "runner"})
    runner.join(120)
    for prompt, answer in zip(joiners, answers, strict=True):
        assert answer["output_ids"] == _greedy_ids(model, tok, prompt, 20), prompt
    assert result["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"
