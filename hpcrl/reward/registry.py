"""Reward functions are named by an import path, ``"package.module:function"``, and resolved by import.

A reward function scores one completion::

    def my_reward(prompt: str, completion: str, answer: str) -> float: ...

``prompt`` is the text the model was given (after the dataset's template), ``completion`` the text it
generated (without the prompt), ``answer`` the row's reference answer (always a str). It returns the
reward as a float; ``bool`` and ``int`` (and numpy numbers) are accepted and converted, so a checker
may return ``True``/``False``. Any other type, NaN or an infinity is an error, never a silent 0. A
function that raises counts as a failed reward; ``reward.on_error`` decides what that does to its group.

The function must live in an importable module: every reward process imports it by name, so a lambda
or a function defined in ``__main__`` cannot be used (they would have to be pickled, which hpcrl never
does).

A function marked with ``@in_process`` promises to be pure Python that returns in microseconds and never
hangs (``mod10`` is one): it is called in the scoring process itself, with no reward processes, no round
trip and no timeout. Anything that parses, calls out or may run long stays unmarked, in the pool.
"""

from __future__ import annotations

import importlib
import math
import numbers
import sys
from collections.abc import Callable
from typing import Any

RewardFn = Callable[[str, str, str], Any]

EXAMPLE = "hpcrl.reward.builtin:mod10"


class RewardSpecError(ValueError):
    """A reward spec cannot be resolved; the message names the spec and what failed."""


def in_process(fn: RewardFn) -> RewardFn:
    """Mark a reward function as safe to call in the scoring process (see the module's docstring)."""
    fn.hpcrl_in_process = True  # type: ignore[attr-defined]
    return fn


def runs_in_process(fn: RewardFn) -> bool:
    """Whether ``fn`` was marked with ``@in_process``."""
    return getattr(fn, "hpcrl_in_process", False) is True


def resolve(spec: str) -> RewardFn:
    """Import ``"package.module:function"`` and return the function; ``RewardSpecError`` if that fails."""
    module_name, attr = _split(spec)
    fn = import_named(module_name, attr, f"reward function {spec!r}", RewardSpecError, "every process")
    if not callable(fn):
        raise RewardSpecError(
            f"reward function {spec!r}: {module_name}.{attr} is a {type(fn).__name__}, not a callable; "
            "expected fn(prompt: str, completion: str, answer: str) -> float"
        )
    return fn


def import_named(module_name: str, attr: str, named: str, error: type[Exception], importers: str) -> Any:
    """``module_name.attr``, imported by name (rewards here, plug-in workflows in ``hpcrl/rollout/workflows``);
    ``error`` with a message starting ``named`` if the module does not import (its cause) or lacks ``attr`` (its
    public callables listed). ``importers``: the processes that must be able to import it."""
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, but also whatever the module raises while it is imported
        raise error(
            f"{named}: cannot import module {module_name!r}: {type(e).__name__}: {e}. The module must be importable "
            f"in {importers} (installed, or on PYTHONPATH)"
        ) from e
    if not hasattr(module, attr):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        where = getattr(module, "__file__", None) or module_name
        raise error(
            f"{named}: module {module_name!r} ({where}) has no attribute {attr!r}; its public callables are: "
            f"{', '.join(defined[:20]) or 'none'}"
        )
    return getattr(module, attr)


def to_reward(value: Any) -> float:
    """A reward function's return value as a float; ``TypeError``/``ValueError`` for anything else or NaN/inf."""
    numpy = sys.modules.get("numpy")  # a checker may return np.bool_, which is not a numbers.Real
    if numpy is not None and isinstance(value, numpy.bool_):
        value = bool(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {_short(value)}; a reward must be a float, int or bool")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"returned {reward}; a reward must be a finite number")
    return reward


def _split(spec: str) -> tuple[str, str]:
    if not isinstance(spec, str):
        raise RewardSpecError(f"reward function {spec!r}: expected a str 'package.module:function', e.g. {EXAMPLE!r}")
    module_name, sep, attr = spec.partition(":")
    ok = bool(sep) and all(part.isidentifier() for part in [*module_name.split("."), attr])
    if not ok:
        raise RewardSpecError(
            f"reward function {spec!r} is not of the form 'package.module:function', e.g. {EXAMPLE!r}"
        )
    if module_name in ("__main__", "__mp_main__"):
        raise RewardSpecError(
            f"reward function {spec!r}: a function in __main__ cannot be imported by the reward processes; "
            "move it into a module and name it as 'package.module:function'"
        )
    return module_name, attr


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
