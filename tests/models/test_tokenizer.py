"""The tiny model's tokenizer loads back exactly as it was made: every character, spaces and newlines too."""

from hpcrl.models.tiny import make_tiny_model, make_tokenizer
from hpcrl.models.tokenizer import load_tokenizer

TEXT = "user:  no, again: \nassistant: 3+4=7"


def test_the_tiny_tokenizer_round_trips_every_character(tmp_path):
    characters = "".join(sorted(set(TEXT)))
    model = make_tiny_model(tmp_path / "m", hidden_size=16, num_layers=1, num_heads=2, characters=characters)
    made, loaded = make_tokenizer(characters), load_tokenizer(model)
    ids = loaded(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == made(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT), "one token per character, none dropped"
    assert loaded.decode(ids) == TEXT
    assert loaded.chat_template == made.chat_template


def test_a_directory_without_the_mark_goes_through_auto_tokenizer(tmp_path):
    make_tokenizer("ab").save_pretrained(tmp_path)  # no tokenizer_class mark: AutoTokenizer decides
    assert load_tokenizer(tmp_path)("ab", add_special_tokens=False)["input_ids"]
