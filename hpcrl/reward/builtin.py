"""Reward functions shipped with hpcrl; name them in config as ``hpcrl.reward.builtin:<name>``.

- ``mod10``: the default job's task, ``"a+b="`` -> ``(a+b) mod 10`` (see ``hpcrl.data.mod10``); a string
  comparison, marked ``@in_process``: it is scored in the calling process, with no reward processes.
- ``math_verify_reward``: a final answer checked for mathematical equality with math-verify, so
  ``0.5``, ``1/2`` and ``\\frac{1}{2}`` all match ``1/2``.
"""

from __future__ import annotations

import re
import threading

from hpcrl.reward.registry import in_process

__all__ = ["extract_answer", "math_verify_reward", "mod10"]


@in_process
def mod10(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion, stripped, starts with the answer digit, else 0.0."""
    target = answer.strip()
    if not target:
        raise ValueError("mod10: the reference answer is empty; expected a digit")
    return 1.0 if completion.strip().startswith(target) else 0.0


# A number: 1,234 (thousands separators) or 1234, an optional decimal part, an optional sign; then an
# optional "/ number" so that a fraction written 1/2 is one answer, not the 2.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_LAST_NUMBER = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?")
_GSM8K = re.compile(r"^\s*####\s*(.+?)\s*\.?\s*$", re.MULTILINE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``, or None when it has none. The first of these that is present wins:

    1. the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, returned as
       ``$content$`` so it is read as LaTeX;
    2. the rest of the last line that starts with ``####`` (GSM8K style), a trailing period dropped;
    3. the last number: an optional sign, digits with optional thousands separators and decimals, and
       an optional ``/ denominator`` (``-1,234.5``, ``.5``, ``3/4``); separators are removed.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return f"${boxed}$"
    marked = _GSM8K.findall(text)
    if marked:
        return marked[-1]
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def math_verify_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final answer (``extract_answer``) equals the reference answer, else 0.0.

    The reference is read whole (``1/2``, ``\\frac{1}{2}``, ``0.5``), or by ``extract_answer`` when it
    holds a ``\\boxed{}`` or a ``####`` line (a GSM8K solution). A completion without an answer scores
    0.0. A reference that math-verify cannot read as math is compared as text; an empty one raises
    ``ValueError`` (bad data, counted as a failed reward rather than scored).

    math-verify bounds its own parsing and comparison with SIGALRM, which only works in a process's main
    thread; that is where reward workers call this. Called from another thread, its timeouts are
    turned off and the caller's timeout (the reward pool's ``timeout_s``) is the only bound.
    """
    from math_verify import parse, verify  # imported here: sympy takes about a second to import

    seconds = 5 if threading.current_thread() is threading.main_thread() else None
    reference = extract_answer(answer) if ("####" in answer or _BOXED.search(answer)) else answer
    gold = _parse(parse, reference or answer, seconds)
    if not gold:
        raise ValueError(f"math_verify_reward: math-verify cannot parse the reference answer {answer!r}")
    found = extract_answer(completion)
    if found is None:
        return 0.0
    predicted = _parse(parse, found, seconds)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=seconds) else 0.0


def _parse(parse, text: str, seconds: int | None) -> list:  # type: ignore[no-untyped-def]
    # As LaTeX first: read as plain text, "1+x^2" would be just its first number, 1.
    latex = text if text.startswith("$") else f"${text}$"
    return parse(latex, parsing_timeout=seconds) or parse(text, parsing_timeout=seconds)


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None
