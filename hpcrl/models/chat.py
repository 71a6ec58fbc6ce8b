"""``python -m hpcrl.models.chat OUT_DIR [--shape tiny|qwen2.5-0.5b]``: a chat model's directory, made here.

A Qwen2-shaped causal LM, randomly initialised, behind a byte-level BPE tokenizer trained here with
``tokenizers`` (Qwen2's pre-tokenizer, so ``AutoTokenizer`` loads it as a ``Qwen2Tokenizer`` that encodes
the same) and saved with a ChatML chat template (``<|im_start|>role\\n...<|im_end|>``), as a real chat model's
directory is: ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``. Tests of chat templates and real-model presets, and ``bench/scale_real_model.py``
(``--shape qwen2.5-0.5b``: Qwen2.5-0.5B's shape, 494M parameters), use it; nothing is downloaded.
``tiny.py`` makes the character-level model of the default job.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PAD, START, END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, START, END)
# ChatML, as Qwen2 writes it (without its default system turn)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2's pre-tokenizer split: letters, single digits, punctuation runs, newlines, spaces
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    # Qwen2.5-0.5B: 24 layers of 896 (14 heads, 2 KV heads), MLP 4864, 151,936 embeddings (tied): 494M parameters
    "qwen2.5-0.5b": dict(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab_size=151936
    ),
}


def corpus(rows: int = 3000, seed: int = 0) -> Iterator[str]:
    """Text to train the tokenizer on: word problems, sums and chat turns, made from a seed."""
    rng = random.Random(seed)
    names = ["Natalia", "Tom", "Weng", "Betty", "James", "Julie", "Ken", "Mark", "Albert", "Alexis"]
    things = ["clips", "apples", "dollars", "pages", "cookies", "marbles", "books", "hours", "miles", "eggs"]
    verbs = ["sold", "bought", "read", "baked", "found", "earned", "walked", "gave away", "collected", "used"]
    for _ in range(rows):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        who, what, did = rng.choice(names), rng.choice(things), rng.choice(verbs)
        yield (
            f"Question: {who} {did} {a} {what} in April, and then {b} {what} in May. How many {what} did "
            f"{who} have in April and May altogether?\nThink step by step, then give the final answer.\n"
            f"Answer: {who} had {a} + {b} = {a + b} {what}. The answer is \\boxed{{{a + b}}}.\n#### {a + b}"
        )
        yield f"{a % 10}+{b % 10}={(a + b) % 10} user assistant system: no, again: {a}*{b}={a * b}; {a}/{b}"


def train_tokenizer(vocab_size: int = 1000, texts: Iterator[str] | None = None) -> Any:
    """A byte-level BPE tokenizer (Qwen2's pre-tokenizer) trained on ``texts`` (default: ``corpus()``), with the
    ChatML special tokens and chat template; every byte has a token, so any text encodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts if texts is not None else corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=END, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_chat_model(
    out_dir: str | Path,
    shape: str = "tiny",
    tokenizer_vocab: int = 1000,
    max_positions: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a Qwen2-shaped model of ``SHAPES[shape]`` (randomly initialised from ``seed``) and a trained chat
    tokenizer of ``tokenizer_vocab`` tokens to ``out_dir``; the model's embedding has ``vocab_size`` rows when the
    shape names one (more than the tokenizer uses, as Qwen2's has), else one per token."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer(tokenizer_vocab)
    config = shape_config(shape, tokenizer, max_positions)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def shape_config(shape: str, tokenizer: Any, max_positions: int = 4096) -> Any:
    """The ``Qwen2Config`` of ``SHAPES[shape]`` for ``tokenizer`` (its special tokens, at least its vocabulary)."""
    from transformers import Qwen2Config

    dims = SHAPES[shape]
    return Qwen2Config(
        vocab_size=max(dims.get("vocab_size", 0), len(tokenizer)),
        hidden_size=dims["hidden_size"],
        num_hidden_layers=dims["num_layers"],
        num_attention_heads=dims["num_heads"],
        num_key_value_heads=dims["num_kv_heads"],
        intermediate_size=dims["intermediate_size"],
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def parameter_count(model_dir_or_config: str | Path | Any) -> int:
    """Parameters of a model (tied embeddings counted once), from its directory's config or a config, on the meta
    device: nothing is allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = model_dir_or_config
    if isinstance(config, (str, Path)):
        config = AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the model and tokenizer to")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--tokenizer-vocab", type=int, default=1000, help="tokens the tokenizer is trained to")
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    out = make_chat_model(args.out_dir, args.shape, args.tokenizer_vocab, args.max_positions, args.seed, args.dtype)
    print(f"{out} ({parameter_count(out) / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
