"""``python -m hpcrl.models.mod10_judge OUT_DIR [--steps N] [--seed S]``: a tiny generative judge of the mod10 task.

The judge is a model of the kind ``tiny.py`` makes (a Qwen2-shaped causal LM behind a character tokenizer; here three
layers, the embeddings untied, the tokenizer's alphabet the task's and ``"?YN"``), trained by plain supervised
learning to say whether a policy's completion of a mod10 prompt is right: the judge prompt ``JUDGE_TEMPLATE``
(``"8+6=4?"``) is answered ``"Y"`` and the end-of-sequence token, ``"8+6=5?"`` ``"N"`` and the end-of-sequence
token. Letters, not the digits ``"1"``/``"0"``, so that a judge's answer cannot be read as a
policy's digit, and a yes/no pattern (``^Y``) parses it.

A completion is right when it is the answer digit. The judge learns completions of one character of the policy's
alphabet or none: a policy that answers in one token (``rollout.max_new_tokens=1``) writes nothing else, and a
policy that writes ``"+"`` or nothing must not please the judge. Longer completions are beyond what it learnt.

Its accuracy is measured on every judgement of a single-digit completion (100 prompts x 10 digits), balanced:
the mean of its accuracy on the 100 right answers and on the 900 wrong ones. The task has no prompts beyond
these 100, so no judgement is unseen in kind; what the figure measures is how well the judging is learnt.
Training and the directory's bytes are deterministic for a seed on one machine (one torch thread). The script always
trains; ``make_judge`` with ``cache`` copies the directory from the per-user cache of ``tiny_cache.py`` when made
before (the tests' fixture does).
"""

from __future__ import annotations

import argparse
from pathlib import Path

JUDGE_TEMPLATE = "{prompt}{completion}?"  # the judge's prompt: the policy's prompt ("8+6=") and completion
YES, NO = "Y", "N"
POLICY_ALPHABET = "+0123456789="  # the mod10 task's characters, which a policy's completion is made of
ALPHABET = "".join(sorted(set(POLICY_ALPHABET + "?" + YES + NO)))  # the judge tokenizer's characters
# tiny.py's model with a third layer: two stayed near 0.89 after 600 batches, three reach 0.99 by 900
SIZES = dict(hidden_size=64, num_layers=3, num_heads=4, intermediate_size=256)
STEPS = 1500  # batches; about two minutes on one CPU thread
BATCH = 128  # judge prompts per batch, half of them right answers
LR, WARMUP = 2e-3, 50  # AdamW's peak learning rate, reached linearly over WARMUP batches, then decayed to 0
SUM_FIRST = 200  # the first batches teach only the sum (see _batch); after 100 some seeds had not learnt it
EMPTY = 0.2  # the share of empty completions among the wrong ones in training
# the share of the digit 5 away from the answer among them: a tiny model first reads the sum mod 5 (it said "Y" to
# every such answer and to no other wrong one), and a wrong answer drawn uniformly is that one too rarely to unlearn it
HALFWAY = 0.2


def judge_prompt(prompt: str, completion: str) -> str:
    """The judge's prompt for a policy's ``prompt`` (``"a+b="``) and its ``completion``."""
    return JUDGE_TEMPLATE.format(prompt=prompt, completion=completion)


def make_judge(out_dir: str | Path, steps: int = STEPS, seed: int = 0, cache: bool = True) -> Path:
    """Train the judge for ``steps`` batches (the first ``SUM_FIRST`` teach only the sum) from ``seed`` and save it,
    with its tokenizer, to ``out_dir``; return the directory. With ``cache`` it is copied from the per-user cache of
    ``tiny_cache.py`` (trained there first if missing), keyed by the arguments and the source of this module,
    ``tiny.py`` and ``tokenizer.py``."""
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"make_judge: steps must be an integer >= 1, got {steps!r}")
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"make_judge: seed must be an integer >= 0, got {seed!r}")
    out = Path(out_dir)

    def build(directory: Path) -> Path:
        return _build_judge(directory, steps, seed)

    if not cache:
        return build(out)
    from hpcrl.models import tiny, tiny_cache, tokenizer

    sources = [Path(__file__), Path(tiny.__file__), Path(tokenizer.__file__)]
    key = tiny_cache.entry_key({"judge": "mod10", "steps": steps, "seed": seed}, sources)
    return tiny_cache.copy_or_build(out, key, build)


def _build_judge(out: Path, steps: int, seed: int) -> Path:
    """Make the judge from its config, train it and save it, with its tokenizer, to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.models.tiny import make_tokenizer, qwen2_config
    from hpcrl.models.tokenizer import mark_exact

    tokenizer = make_tokenizer(ALPHABET)
    config = qwen2_config(tokenizer, **SIZES)
    # untied: tied, "Y" and "N" left the sum phase alike, and one seed of three never learnt to tell them apart
    config.tie_word_embeddings = False
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # sums in one order: the same weights on every run (a tiny model is no faster on more)
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            _train(model, tokenizer, steps, torch.Generator().manual_seed(seed))
    finally:
        torch.set_num_threads(threads)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    mark_exact(out)  # loaded as saved, not rebuilt as a byte-level Qwen2 tokenizer (tokenizer.py)
    return out


def _train(model, tokenizer, steps: int, generator) -> None:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1, (step + 1) / WARMUP) * (1 - step / steps)
    )
    model.train()
    for step in range(steps):
        ids, labels = _batch(tokenizer, BATCH, generator, judge=step >= SUM_FIRST)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()


def _batch(tokenizer, size: int, generator, judge: bool):
    """``size`` judge prompts with their answers, half of them right; the token ids and the labels.

    Labelled is the answer digit after ``"="`` (whatever the completion there is: the sum the judge compares the
    completion with, which it learns first and fast), and with ``judge`` the judge's answer and end of sequence.
    Taught both from the first batch, the model learnt neither in 1000 batches (two seeds).
    """
    import torch

    pairs = torch.randint(0, 10, (size, 2), generator=generator).tolist()
    draws = torch.rand(size, 3, generator=generator).tolist()
    rows = [_completion(a, b, *draw) for (a, b), draw in zip(pairs, draws, strict=True)]
    ids = torch.full((size, max(len(text) for text, _ in rows) + 2), tokenizer.pad_token_id)
    labels = torch.full_like(ids, -100)
    for row, ((a, b), (text, answer)) in enumerate(zip(pairs, rows, strict=True)):
        tokens = tokenizer(text + answer)["input_ids"] + [tokenizer.eos_token_id]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, 4] = tokenizer.convert_tokens_to_ids(str((a + b) % 10))  # "a+b=" is 4 tokens
        if judge:
            labels[row, len(tokens) - 2 : len(tokens)] = torch.tensor(tokens[-2:])
    return ids, labels


def _completion(a: int, b: int, right: float, empty: float, wrong: float) -> tuple[str, str]:
    """A judge prompt and its answer from three uniform draws: a right completion (the answer digit) or a wrong one
    (another character of the policy's alphabet; with chance ``EMPTY`` none, with ``HALFWAY`` the digit 5 away)."""
    answer = str((a + b) % 10)
    others = [c for c in POLICY_ALPHABET if c != answer]
    if right < 0.5:
        completion = answer
    elif empty < EMPTY:
        completion = ""
    elif empty < EMPTY + HALFWAY:
        completion = str((a + b + 5) % 10)
    else:
        completion = others[int(wrong * len(others))]
    return judge_prompt(f"{a}+{b}=", completion), YES if completion == answer else NO


def judgements() -> list[tuple[str, str]]:
    """Every single-digit judgement: ``(judge prompt, expected answer)`` for each of 100 prompts x 10 digits."""
    return [
        (judge_prompt(f"{a}+{b}=", str(c)), YES if (a + b) % 10 == c else NO)
        for a in range(10)
        for b in range(10)
        for c in range(10)
    ]


def judge_accuracy(model_dir: str | Path) -> float:
    """The judge's balanced accuracy on ``judgements()``: the mean of its accuracies on right and on wrong answers,
    each answer its greedy first token."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.models.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(model_dir)
    cases = judgements()
    ids = torch.tensor([tokenizer(prompt)["input_ids"] for prompt, _ in cases])  # all of one length
    with torch.no_grad():
        first = model(input_ids=ids).logits[:, -1].argmax(-1).tolist()
    said = tokenizer.convert_ids_to_tokens(first)
    per_class = [
        [s == expected for s, (_, expected) in zip(said, cases, strict=True) if expected == label]
        for label in (YES, NO)
    ]
    return sum(sum(hits) / len(hits) for hits in per_class) / 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the judge and its tokenizer to")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training batches of {BATCH} (default {STEPS})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_judge(args.out_dir, steps=args.steps, seed=args.seed, cache=False)
    print(f"{out}: judging accuracy {judge_accuracy(out):.4f} (balanced, 100 right and 900 wrong answers)")


if __name__ == "__main__":
    main()
