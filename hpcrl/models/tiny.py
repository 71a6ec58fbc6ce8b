"""``python -m hpcrl.models.tiny OUT_DIR``: write a tiny Qwen2-style causal LM and a character tokenizer.

The model is built from a config (no download) and saved in the Hugging Face layout, so the real
loading path (``AutoModelForCausalLM.from_pretrained(OUT_DIR)``, ``load_tokenizer(OUT_DIR)``) is what every
test and the default job exercise. One token per character keeps the tokenizer exact and reversible: a
multi-turn conversation never drifts when re-tokenised.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

from hpcrl.models.tokenizer import mark_exact

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
MAX_POSITIONS = 512  # the tiny model's context (max_position_embeddings), which the default job makes it with
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
# A minimal chat template so multi-turn workflows can render turns the way real chat models do.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tokenizer(characters: str = CHARACTERS):
    """A character-level tokenizer: ids 0..2 are special, then one id per character of ``characters``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *dict.fromkeys(characters)))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = MAX_POSITIONS,
    seed: int = 0,
    characters: str = CHARACTERS,
    cache: bool = True,
) -> Path:
    """Write a seeded tiny Qwen2 model and its tokenizer to ``out_dir``; return the directory.

    ``characters`` is the tokenizer's alphabet: a task's own characters make a small vocabulary, so an
    untrained model already guesses a task's one-character answers at a useful rate. With ``cache`` the files
    are copied from the per-user cache of ``tiny_cache.py`` (built there first if missing): the same bytes as
    building them here, without importing transformers' model code.
    """
    arguments = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_positions=max_positions,
        seed=seed,
        characters=characters,
    )

    def build(out: Path) -> Path:
        return _build_tiny_model(out, **arguments)

    out = Path(out_dir)
    if not cache:
        return build(out)
    from hpcrl.models import tiny_cache, tokenizer

    key = tiny_cache.entry_key(arguments, [Path(__file__), Path(tokenizer.__file__)])
    return tiny_cache.copy_or_build(out, key, build)


def _build_tiny_model(out: Path, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                      max_positions: int, seed: int, characters: str) -> Path:  # fmt: skip
    """Build the model of ``make_tiny_model`` from its config and save it, with its tokenizer, to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer(characters)
    sizes = (hidden_size, num_layers, num_heads, intermediate_size, max_positions)
    config = qwen2_config(tokenizer, *sizes)
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was, as a cached copy leaves it
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    mark_exact(out)  # loaded as saved, not rebuilt as a byte-level Qwen2 tokenizer (tokenizer.py)
    return out


def qwen2_config(tokenizer, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                 max_positions: int = MAX_POSITIONS):  # fmt: skip
    """The tiny model's transformers config: a Qwen2 of these sizes with tied embeddings, for ``tokenizer``."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def tiny_config(tiny):
    """The config of the tiny model ``model.tiny`` (a ``TinyModelConfig``) makes, with the full alphabet: its module
    names, for checks before the model is made."""
    return qwen2_config(make_tokenizer(), tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.intermediate_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the model and tokenizer to")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--max-positions", type=int, default=MAX_POSITIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--characters", default=CHARACTERS, help="the tokenizer's alphabet (default: printable)")
    args = parser.parse_args(argv)
    out = make_tiny_model(
        args.out_dir,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        max_positions=args.max_positions,
        seed=args.seed,
        characters=args.characters,
    )
    print(out)


if __name__ == "__main__":
    main()
