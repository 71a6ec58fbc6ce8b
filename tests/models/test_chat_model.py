"""The chat model made here (``hpcrl/models/chat.py``) is what a real chat model's directory is: a BPE tokenizer
that ``AutoTokenizer`` loads as a Qwen2 tokenizer encoding the same ids, a chat template whose special tokens are
single tokens, and a Qwen2 model ``AutoModelForCausalLM`` loads; its 0.5B shape is Qwen2.5-0.5B's."""

import pytest

from hpcrl.models.chat import END, START, make_chat_model, parameter_count, shape_config, train_tokenizer
from hpcrl.models.tokenizer import load_tokenizer

TEXT = "Question: Natalia sold 48 clips in April. How many?\n  Answer: 48 + 24 = 72 #### 72 — naïve 😀"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat") / "model", shape="tiny", seed=0)


def test_auto_tokenizer_loads_it_as_qwen2_and_encodes_the_same_ids(chat_model):
    from transformers import AutoTokenizer

    made, auto = load_tokenizer(chat_model), AutoTokenizer.from_pretrained(chat_model)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    ids = made(TEXT, add_special_tokens=False)["input_ids"]
    assert auto(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert made.decode(ids) == TEXT, "byte-level: any text round-trips, accents and emoji too"
    assert len(ids) < len(TEXT.encode()) * 0.6, "trained merges: far fewer tokens than bytes"


def test_the_chat_template_renders_chatml_with_special_tokens_as_single_ids(chat_model):
    tokenizer = load_tokenizer(chat_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"{START}system\nBe brief.{END}\n{START}user\nWhat is 2+2?{END}\n{START}assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start, end = tokenizer.convert_tokens_to_ids([START, END])
    assert ids.count(start) == 3 and ids.count(end) == 2
    assert tokenizer.eos_token == END, "generation stops at the end of the assistant's turn"


def test_the_model_loads_and_generates(chat_model):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat_model)
    tokenizer = load_tokenizer(chat_model)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tokenizer)
    ids = tokenizer("What is 2+2?", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1] and torch.equal(out[0, : ids.shape[1]], ids[0])


def test_the_half_billion_shape_is_qwen2_5_0_5b():
    config = shape_config("qwen2.5-0.5b", train_tokenizer(300))
    assert parameter_count(config) == 494_032_768  # Qwen2.5-0.5B's count: 151,936 tied embeddings of 896
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (24, 896, 2)
