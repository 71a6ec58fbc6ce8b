"""docs/quickstart.md's walk from a model directory and a jsonl file to the trained model, run as written (paths
moved to a temporary directory, the run shortened as the page says): a Qwen2-shaped chat model made here with a
BPE tokenizer and a chat template (``hpcrl/models/chat.py``), a string row and a conversation row, the
``experiment=gsm8k`` preset, then ``final/`` loaded with ``AutoModelForCausalLM`` and ``AutoTokenizer``."""

import json
import re
import shlex

import pytest

from hpcrl.models.chat import END, START, make_chat_model
from tests.conftest import REPO, run_main

PAGE = (REPO / "docs" / "quickstart.md").read_text()
SECTION = PAGE[PAGE.index("## Your own model and data") : PAGE.index("## Settings for a real model")]


def page_data() -> str:
    """The jsonl rows step 2 writes."""
    (rows,) = re.findall(r"cat > /tmp/train.jsonl <<'JSON'\n(.*?)JSON\n", SECTION, re.S)
    return rows


def page_command(module: str) -> list[str]:
    """Step 4's ``python -m MODULE ...`` command (its continuation lines joined), as arguments."""
    (command,) = re.findall(rf"^(python -m {module} .*?)$(?<!\\)", SECTION.replace("\\\n", " "), re.M)
    return shlex.split(command)[3:]


def page_shortening() -> list[str]:
    (short,) = re.findall(r"Here, on CPUs, shorten it:\n`([^`]+)`", SECTION)
    return short.split()


@pytest.mark.slow
def test_the_quickstart_from_a_model_directory_and_a_jsonl_file_to_the_trained_model(tmp_path):
    model = make_chat_model(tmp_path / "my-model", shape="tiny", seed=0)
    (tmp_path / "train.jsonl").write_text(page_data())
    moved = [a.replace("/tmp/", f"{tmp_path}/") for a in page_command("hpcrl.main")]
    assert "run.dry_run=true" in moved and f"model.path={model}" in moved
    runs = f"run.root={tmp_path / 'runs'}"

    dry = run_main(*moved, runs, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "keeps the tiny task's" not in dry.stderr, "the preset sets what a real model needs"

    run = [a for a in moved if a != "run.dry_run=true" and not a.startswith("run.trial=")]
    run += [*page_shortening(), "run.trial=real"]
    result = run_main(*run, runs, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    run_dir = tmp_path / "runs" / "gsm8k" / "real"
    assert summary["steps"] == 2 and summary["final_model"] == str(run_dir / "final")

    log = (run_dir / "logs" / "controller-0.log").read_text()
    (first,) = re.findall(r"the first row's prompt as the model sees it \(dataset.chat_template=auto\): (.*)", log)
    # the first training row left after one is held out: a templated string or the conversation, in ChatML
    assert first.startswith(repr(START)[:-1]) and f"{END}\\n{START}assistant\\n'" in first
    assert "Think step by step" in first, "gsm8k's prompt template went onto the question"
    assert len(re.findall(r"step \d: reward", log)) == 2

    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run_dir / "final"
    trained = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert trained.config.model_type == "qwen2" and tokenizer.chat_template
    assert (final / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = trained.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]
