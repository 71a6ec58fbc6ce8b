"""Model rewards shipped with hpcrl; name them in config as ``hpcrl.reward.judge:<name>``.

- ``llm_judge``: a generative judge (reward.model.kind=generative). ``reward.judge.template`` (or the file
  ``reward.judge.template_file``) is formatted with the row's columns and ``prompt``, ``completion``, ``answer``
  (``str.format``: ``"{prompt}{completion}?"``), sent to the judge through ``/generate`` with reward.judge's
  ``max_new_tokens`` and ``temperature``, and its answer read with ``reward.judge.pattern`` (``re.search``): a
  pattern without a group scores 1.0 when it matches and 0.0 when it does not (a yes/no judge); with a group the
  score is ``float(group(1))`` (a grade), and an answer it does not match is a failed reward naming the answer.
- ``reward_model_score``: a discriminative reward model (reward.model.kind=discriminative): the score of
  ``prompt + completion`` from ``/classify``.

A template naming a column the data lacks, a template file that does not exist, and a pattern that does not compile
are refused before the run (``hpcrl.config.preflight``, through ``template_text``, ``template_columns`` and
``compiled_pattern``).
"""

from __future__ import annotations

import re
import string
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpcrl.reward.model_client import RewardModel
from hpcrl.reward.registry import OWN_NAMES

__all__ = ["compiled_pattern", "llm_judge", "reward_model_score", "score_answer", "template_columns", "template_text"]

LLM_JUDGE = "hpcrl.reward.judge:llm_judge"
REWARD_MODEL_SCORE = "hpcrl.reward.judge:reward_model_score"
KIND_OF = {LLM_JUDGE: "generative", REWARD_MODEL_SCORE: "discriminative"}  # the reward.model.kind each one needs


async def llm_judge(prompt: str, completion: str, answer: str, reward_model: RewardModel, **row: Any) -> float:
    """The judge's verdict on ``completion`` (the module docstring)."""
    judge = reward_model.judge
    fields = {**row, "prompt": prompt, "completion": completion, "answer": answer}
    text = _template(judge.template, judge.template_file).format(**fields)
    said = await reward_model.generate(text)
    return score_answer(said, judge.pattern)


async def reward_model_score(prompt: str, completion: str, reward_model: RewardModel) -> float:
    """The discriminative reward model's score of ``prompt + completion``."""
    return await reward_model.classify(prompt + completion)


def score_answer(said: str, pattern: str) -> float:
    """The score of the judge's answer ``said``: ``pattern`` without a group, 1.0 on a match else 0.0; with one,
    ``float(group(1))``, and ``ValueError`` naming the answer when it does not match or the group is no number."""
    regex = compiled_pattern(pattern)
    found = regex.search(said)
    if regex.groups == 0:
        return 1.0 if found else 0.0
    if found is None or found.group(1) is None:
        raise ValueError(f"llm_judge: the judge answered {said!r}; reward.judge.pattern {pattern!r} does not match it")
    try:
        return float(found.group(1))
    except ValueError:
        raise ValueError(
            f"llm_judge: the judge answered {said!r}; reward.judge.pattern {pattern!r} reads {found.group(1)!r}, not a "
            "number"
        ) from None


@lru_cache(maxsize=16)
def compiled_pattern(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled; ``re.error`` when it is no regular expression."""
    return re.compile(pattern)


def template_text(template: str, template_file: str) -> str:
    """The judge's template: the file's text when ``template_file`` names one, else ``template``; ``OSError`` for
    a file that cannot be read."""
    return Path(template_file).expanduser().read_text() if template_file else template


@lru_cache(maxsize=16)
def _template(template: str, template_file: str) -> str:
    return template_text(template, template_file)  # read once per process, not once per completion


def template_columns(template: str) -> list[str]:
    """The data columns ``template`` names (its fields besides prompt, completion and answer), in order;
    ``ValueError`` for a template ``str.format`` cannot read (an unmatched brace, an empty or positional field)."""
    names: list[str] = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not name or name.isdigit():
            raise ValueError(f"the field {{{field}}} names no column: name one, e.g. {{prompt}} or {{question}}")
        if name not in OWN_NAMES and name not in names:
            names.append(name)
    return names
