"""Chat templates: ``dataset.chat_template=true|false|auto`` on string prompts, and chat-format rows (a list of
``{role, content}`` messages) through the template, tested with a tokenizer that has one (``hpcrl/models/chat.py``)
and one that has none; the first rendered prompt is logged once."""

import json
import logging

import pytest

from hpcrl.data import DataError, load_rows
from hpcrl.data.chat import render_prompts
from hpcrl.models.chat import END, START, train_tokenizer


@pytest.fixture(scope="module")
def templated():
    return train_tokenizer(400)


@pytest.fixture(scope="module")
def plain():
    tokenizer = train_tokenizer(400)
    tokenizer.chat_template = None  # a base model's tokenizer
    return tokenizer


ROWS = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "And 3+3?", "answer": "6"}]
USER_TURN = f"{START}user\nWhat is 2+2?{END}\n{START}assistant\n"


@pytest.mark.parametrize(("mode", "expected"), [("true", USER_TURN), ("auto", USER_TURN), ("false", "What is 2+2?")])
def test_string_prompts_go_through_the_template_as_set(templated, mode, expected):
    rendered = render_prompts(ROWS, templated, mode)
    assert rendered[0] == {"prompt": expected, "answer": "4"}
    assert rendered[1]["prompt"].startswith(START if mode != "false" else "And")


def test_auto_without_a_template_sends_the_text_and_true_refuses(plain):
    assert render_prompts(ROWS, plain, "auto") == ROWS
    with pytest.raises(DataError, match=r"dataset\.chat_template=true, but the tokenizer at M has no chat template"):
        render_prompts(ROWS, plain, "true", where="the tokenizer at M")


def test_the_first_rendered_prompt_is_logged_once(templated, caplog):
    with caplog.at_level(logging.INFO, logger="hpcrl.data.chat"):
        render_prompts(ROWS * 50, templated, "auto")
    (record,) = [r for r in caplog.records if r.name == "hpcrl.data.chat"]
    assert repr(USER_TURN) in record.getMessage()


def test_chat_format_rows_load_and_render_as_conversations(tmp_path, templated, plain):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5+5?"}]
    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"q": "What is 2+2?", "a": 4}) + "\n" + json.dumps({"q": conversation, "a": "10", "extra": 1}) + "\n"
    )
    rows = load_rows([str(path)], "q", "a", "Q: {prompt}", cache_dir=str(tmp_path / "cache")).to_list()
    # the template goes on the string prompt, and on the conversation's last user message
    assert rows[0] == {"prompt": "Q: What is 2+2?", "answer": "4", "messages": ""}
    assert json.loads(rows[1]["messages"])[1] == {"role": "user", "content": "Q: What is 5+5?"}
    rendered = render_prompts(rows, templated, "auto")
    assert rendered[0] == {"prompt": f"{START}user\nQ: What is 2+2?{END}\n{START}assistant\n", "answer": "4"}
    conversation_turns = f"{START}system\nBe brief.{END}\n{START}user\nQ: What is 5+5?{END}\n{START}assistant\n"
    assert rendered[1] == {"prompt": conversation_turns, "answer": "10"}
    # a conversation cannot be text without a template
    with pytest.raises(DataError, match=r"row 1 is a conversation .* is not used: dataset\.chat_template=false"):
        render_prompts(rows, templated, "false")
    with pytest.raises(DataError, match=r"row 1 is a conversation .* has no chat template"):
        render_prompts(rows, plain, "auto")


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([{"role": "user"}], "column 'q': message 0 is a dict ({'role': 'user'}); expected a string prompt, or a list"),
        ([], "column 'q' is a list ([]); expected a string prompt, or a list of {role, content} messages"),
        ([{"role": "system", "content": "x"}], "applies to a conversation's last user message, and this one has none"),
    ],
)
def test_a_bad_conversation_names_the_file_row_and_line(tmp_path, prompt, says):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"q": "fine", "a": 1}) + "\n\n" + json.dumps({"q": prompt, "a": 2}) + "\n")
    with pytest.raises(DataError) as err:
        load_rows([str(path)], "q", "a", "Q: {prompt}", cache_dir=str(tmp_path / "cache"))
    assert str(err.value).startswith(f"{path}: row 1 (line 3): ") and says in str(err.value)
