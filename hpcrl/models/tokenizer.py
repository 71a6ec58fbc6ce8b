"""``load_tokenizer(path)``: a model directory's tokenizer, exactly as it was saved.

transformers 5 picks a tokenizer class from the model's type (``qwen2`` -> ``Qwen2Tokenizer``) and rebuilds
that class's own pre-tokenizer and normaliser around the saved vocabulary. For a real Qwen2 checkpoint that
is the same thing; for hpcrl's tiny character tokenizer (``tiny.py``) it silently drops spaces, newlines and
every character the byte-level scheme does not map, so ``"a b\\nc"`` would encode as ``"a"``. A directory
whose ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` is therefore loaded with that class,
straight from its ``tokenizer.json``; every other directory goes through ``AutoTokenizer`` as usual.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcrl.errors import UserError

EXACT_CLASS = "PreTrainedTokenizerFast"  # what tiny.py writes into tokenizer_config.json


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in ``path``; a ``UserError`` naming the directory and transformers' reason when its files
    do not load (a ``tokenizer.json`` that is no tokenizer, a config that names no known class)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        config = Path(path) / "tokenizer_config.json"
        saved_class = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
        if saved_class == EXACT_CLASS:
            return PreTrainedTokenizerFast.from_pretrained(path)
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # what transformers raises for files it cannot read varies (KeyError, OSError, ...)
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise UserError(
            f"the tokenizer in {path} does not load ({reason})",
            hint="a model directory needs its tokenizer's files as save_pretrained wrote them (tokenizer.json, "
            "tokenizer_config.json)",
        ) from e


def mark_exact(path: str | Path) -> None:
    """Record in ``path``'s tokenizer_config.json that ``load_tokenizer`` must load it as saved."""
    config = Path(path) / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["tokenizer_class"] = EXACT_CLASS
    config.write_text(json.dumps(settings, indent=2))
