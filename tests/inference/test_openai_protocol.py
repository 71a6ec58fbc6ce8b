"""The OpenAI request bodies, chat rendering and tool-call parsing shared by the CPU server and the proxy
(``hpcrl/inference/openai``), without a server: each check is one a wrong table or parser would fail."""

import json

import pytest

from hpcrl.inference.openai.chat import ChatFormat, decode_answer, normalize_messages, parse_hermes, resolve_template
from hpcrl.inference.openai.errors import OpenAIError
from hpcrl.inference.openai.protocol import Choice, Sampling, chat_response, parse_chat, parse_completion, usage
from hpcrl.inference.openai.templates import TINY_TOOLS
from hpcrl.models.tiny import make_tokenizer

USER = [{"role": "user", "content": "3+4="}]
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}


def refused(body: dict, parse=parse_chat) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(body)
    return caught.value


def test_a_chat_body_becomes_sampling_parameters_with_sglangs_names():
    req = parse_chat(
        {"model": "m", "messages": USER, "max_completion_tokens": 3, "max_tokens": 9, "temperature": 0.5, "n": 2}
        | {"top_p": 0.9, "stop": "\n", "seed": 7, "logprobs": True, "top_k": 5}
    )
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.n, s.stop, s.seed, s.logprobs) == (
        3, 0.5, 0.9, 5, 2, ["\n"], 7, True
    )  # fmt: skip
    assert s.params({"temperature": 1.0, "max_new_tokens": 4}) == {
        "max_new_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": ["\n"]
    }  # fmt: skip
    assert req.tool_choice == "none"  # SGLang's default without tools


def test_unset_sampling_parameters_take_the_callers_defaults():
    s = parse_chat({"messages": USER}).sampling
    assert s.params({"temperature": 1.0, "max_new_tokens": 2, "top_k": -1}) == {
        "temperature": 1.0, "max_new_tokens": 2, "top_k": -1
    }  # fmt: skip
    completion = parse_completion({"prompt": "3+4="}).sampling
    assert (completion.max_new_tokens, completion.temperature, completion.top_p) == (16, 1.0, 1.0)  # SGLang's


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"stream": True}, "stream"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"regex": "[0-9]"}, "regex"),
        ({"store": True}, "unknown field 'store'"),
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "'n'"),
        ({"tool_choice": "required", "tools": [TOOL]}, "constrained decoding"),
        ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}, "tools": [TOOL]}, "named"),
        ({"tool_choice": "required"}, "Tools cannot be empty"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(body, names):
    error = refused({"messages": USER, **body})
    assert error.status == 400 and names in str(error)


def test_defaults_are_accepted_where_only_defaults_are_honoured():
    body = {"messages": USER, "stream": False, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": None}
    body |= {"response_format": {"type": "text"}, "user": "u1", "parallel_tool_calls": False, "top_logprobs": 0}
    assert parse_chat(body).sampling.n == 1


def test_completion_bodies_take_sglangs_four_prompt_forms():
    assert parse_completion({"prompt": "ab"}).prompts == ["ab"]
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion({"prompt": [5, 6]}).prompts == [[5, 6]]
    assert parse_completion({"prompt": [[5], [6, 7]]}).prompts == [[5], [6, 7]]
    assert "Prompt cannot be empty" in str(refused({"prompt": ""}, parse_completion))
    assert "logprobs" in str(refused({"prompt": "a", "logprobs": 3}, parse_completion))
    assert "echo" in str(refused({"prompt": "a", "echo": True}, parse_completion))


CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3+4"}'}}


def test_messages_are_normalised_as_sglang_does_before_templating():
    messages = normalize_messages(
        [
            {"role": "User", "content": [{"type": "text", "text": "3+"}, {"type": "text", "text": "4="}]},
            {"role": "assistant", "content": None, "refusal": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "7"},
        ]
    )  # fmt: skip
    assert messages[0] == {"role": "user", "content": "3+4="}
    assert messages[1]["content"] == "" and "refusal" not in messages[1]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "3+4"}
    with pytest.raises(OpenAIError, match="only text content parts"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(OpenAIError, match="'role' must be one of"):
        normalize_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(OpenAIError, match="unknown field"):
        normalize_messages([{"role": "user", "content": "x", "colour": "red"}])


def test_the_tiny_tools_template_renders_a_call_and_its_result_without_markers():
    chat = ChatFormat(make_tokenizer(), "tiny_tools", "tiny")
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": {}}}
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "7"}]
    assert chat.render(USER, [TOOL]) == "3+4="
    assert chat.render(history) == "3+4=?7="
    assert chat.render([*history, {"role": "assistant", "content": "7"}]) == "3+4=?7=7"
    assert set(chat.own_text()) == {"?", "="}  # all it adds to the task's alphabet
    assert resolve_template("tiny_tools") == TINY_TOOLS
    with pytest.raises(ValueError, match="neither one of hpcrl's"):
        resolve_template("no_such_template")


def test_the_tokenizers_own_template_is_the_default():
    tokenizer = make_tokenizer()
    chat = ChatFormat(tokenizer)
    assert chat.render(USER) == tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert chat.prompt_ids(USER) == tokenizer(chat.render(USER), add_special_tokens=False)["input_ids"]


def test_the_tiny_parser_reads_exactly_one_question_mark_as_the_one_tools_call():
    chat = ChatFormat(make_tokenizer(), "tiny_tools", "tiny")
    content, calls = chat.parse("?", [TOOL])
    assert content == "" and [c["function"] for c in calls] == [{"name": "calculator", "arguments": "{}"}]
    assert calls[0]["id"].startswith("call_")
    assert chat.parse("?7", [TOOL]) == ("?7", [])
    assert chat.parse("?", [TOOL], tool_choice="none") == ("?", [])
    assert chat.parse("?", []) == ("?", [])
    with pytest.raises(OpenAIError, match="one tool"):
        chat.check_tools([TOOL, {"type": "function", "function": {"name": "other"}}], "auto")


def test_the_hermes_parser_reads_tool_call_blocks():
    text = 'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>'
    content, calls = parse_hermes(text, ["calculator"])
    assert content == "Let me compute."
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "3+4"}
    assert parse_hermes('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', ["calculator"])[1] == []
    assert parse_hermes("<tool_call>not json</tool_call>", ["calculator"]) == ("<tool_call>not json</tool_call>", [])
    assert parse_hermes("no call", ["calculator"]) == ("no call", [])


def test_an_answer_drops_its_stop_token_and_the_text_from_its_stop_string():
    tokenizer = make_tokenizer()
    ids = tokenizer("7 ok\nmore", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    assert decode_answer(tokenizer, [*ids[:1], eos], "stop", Sampling(), {eos}) == ("7", eos)
    assert decode_answer(tokenizer, ids, "stop", Sampling(stop=["\n"]), {eos}) == ("7 ok", "\n")
    assert decode_answer(tokenizer, ids, "stop", Sampling(stop=["\n"], no_stop_trim=True), {eos}) == (
        "7 ok\nmore",
        "\n",
    )
    assert decode_answer(tokenizer, ids, "length", Sampling(stop=["\n"]), {eos}) == ("7 ok\nmore", None)


def test_usage_counts_a_prompt_once_for_its_n_answers():
    choices = [Choice([5, 6], "ab", "length", prompt_tokens=4), Choice([7], "c", "stop", prompt_tokens=4)]
    assert usage(choices, n=2) == {
        "prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }  # fmt: skip
    answer = chat_response("chatcmpl-1", "m", choices, 2, "3")
    assert [c["index"] for c in answer["choices"]] == [0, 1] and answer["metadata"] == {"weight_version": "3"}
    assert "tool_calls" not in answer["choices"][0]["message"]
