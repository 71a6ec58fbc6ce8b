"""The mod10 judge (``hpcrl/models/mod10_judge.py``): it loads with transformers, judges every single-digit answer,
is served by hpcrl's CPU server, and is the same bytes for a seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpcrl.models import mod10_judge
from hpcrl.models.tokenizer import load_tokenizer
from tests.inference.conftest import ServerProc

# (policy prompt, completion, the judge's answer): right, wrong digits (one 5 away), nothing, a non-digit
CASES = [
    ("8+6=", "4", "Y"),
    ("8+6=", "5", "N"),
    ("8+6=", "9", "N"),
    ("0+0=", "0", "Y"),
    ("9+9=", "8", "Y"),
    ("9+9=", "9", "N"),
    ("3+4=", "", "N"),
    ("3+4=", "=", "N"),
    ("5+5=", "+", "N"),
]


def test_the_judge_loads_with_transformers_and_judges_single_digit_answers(mod10_judge_dir):
    model = AutoModelForCausalLM.from_pretrained(mod10_judge_dir)
    tokenizer = load_tokenizer(mod10_judge_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_hidden_layers == 3
    assert tokenizer("8+6=4?Y")["input_ids"] == [tokenizer.convert_tokens_to_ids(c) for c in "8+6=4?Y"]
    cases = mod10_judge.judgements()
    assert len(cases) == 1000 and sum(answer == "Y" for _, answer in cases) == 100
    assert ("8+6=4?", "Y") in cases and ("8+6=5?", "N") in cases
    assert mod10_judge.judge_accuracy(mod10_judge_dir) >= 0.98


def test_the_cpu_server_serves_the_judge(mod10_judge_dir, tmp_path):
    prompts = [mod10_judge.judge_prompt(prompt, completion) for prompt, completion, _ in CASES]
    tokenizer = load_tokenizer(mod10_judge_dir)
    server = ServerProc(mod10_judge_dir, tmp_path / "server.log")
    try:
        body = {"text": prompts, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        status, answers = server.post("/generate", body)
    finally:
        server.stop()
    assert status == 200, answers
    assert [a["text"] for a in answers] == [answer for _, _, answer in CASES]
    for answer, (_, _, expected) in zip(answers, CASES, strict=True):  # the answer, then the end of sequence
        assert answer["output_ids"] == [tokenizer.convert_tokens_to_ids(expected), tokenizer.eos_token_id]
        assert answer["meta_info"]["finish_reason"]["type"] == "stop"


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_the_judge_is_the_same_bytes_for_a_seed(tmp_path, monkeypatch):
    monkeypatch.setattr(mod10_judge, "SUM_FIRST", 2)  # a few batches of each phase: the bytes, not the judging
    made = []
    for caller_seed, seed in ((0, 3), (1, 3), (0, 4)):
        torch.manual_seed(caller_seed)  # whatever the caller's random state
        made.append(files(mod10_judge.make_judge(tmp_path / str(len(made)), steps=4, seed=seed, cache=False)))
    assert made[0] == made[1]
    assert made[0]["model.safetensors"] != made[2]["model.safetensors"]


@pytest.mark.parametrize("arguments", [{"steps": 0}, {"seed": -1}, {"steps": 1.5}])
def test_make_judge_refuses_bad_arguments(tmp_path, arguments):
    with pytest.raises(ValueError, match=f"make_judge: {next(iter(arguments))} must be an integer"):
        mod10_judge.make_judge(tmp_path, **arguments)
