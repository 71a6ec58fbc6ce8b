"""Reward functions are named by an import path, ``"package.module:function"``, and resolved by import.

A reward function scores one completion. It takes its arguments by name, as TRL's reward functions take the
dataset's columns as keyword arguments::

    def my_reward(prompt: str, completion: str, answer: str) -> float: ...
    def in_range(completion: str, low: int, high: int) -> float: ...           # the row's columns "low" and "high"
    def graded(completion: str, answer: str, **row) -> float: ...             # every column besides, in ``row``

``prompt`` is the text the model was given (after the dataset's template), ``completion`` the text it
generated (without the prompt), ``answer`` the row's reference answer (always a str). Every other name is a
column of the row (a data file's column, its value as the file holds it: str, number, bool, list, dict or
None), so a reward may read any column, not only the answer; a function with ``**kwargs`` gets every column
(and whichever of prompt, completion and answer it does not name). Those three names are hpcrl's: a column
called ``prompt`` or ``answer`` is reached through ``prompt_template`` or ``dataset.answer_column``. A name
that is neither one of them nor a column of the data, without a default, is refused before the run starts
(``hpcrl.config.preflight``); a positional-only parameter is refused when the function is resolved. A
callable whose signature Python cannot read is called as ``fn(prompt, completion, answer)``.

It returns the reward as a float; ``bool`` and ``int`` (and numpy numbers) are accepted and converted, so
a checker may return ``True``/``False``. Any other type, NaN or an infinity is an error, never a silent 0.
A function that raises counts as a failed reward; ``reward.on_error`` decides what that does to its group.

``reward.fn`` may name one function or a list of them (``RewardFns``): the reward is then their weighted sum
(``reward.weights``, 1 each by default), and each function's own value is kept under its name (the part
after the colon) so the metrics log it as ``reward/<name>``. One that fails fails the call.

The function must live in an importable module: every reward process imports it by name, so a lambda
or a function defined in ``__main__`` cannot be used (they would have to be pickled, which hpcrl never
does).

A **model reward** asks the reward model (``allocation.reward_model``'s servers, serving ``reward.model.path``): it is
an ``async def`` that names a parameter ``reward_model``, and gets a ``hpcrl.reward.model_client.RewardModel``::

    async def judged(prompt: str, completion: str, reward_model) -> float:
        answer = await reward_model.generate(f"{prompt}{completion}?")   # reward.judge's sampling settings
        return 1.0 if answer.startswith("Y") else 0.0
    async def scored(prompt: str, completion: str, reward_model) -> float:
        return await reward_model.classify(prompt + completion)          # a discriminative reward model

``reward_model.generate(text, max_new_tokens=None, temperature=None) -> str`` (``/generate``; None: reward.judge's
setting) and ``reward_model.classify(text) -> float`` (``/classify``); ``reward_model.judge`` is the run's
``reward.judge``. It runs in the scoring process's event loop, not in the reward processes, each call bounded by
``reward.timeout_s``; a timeout or an exception is a failed reward like any other (``reward.on_error``). The calls
of one ``score`` (a group's completions) made in the same tick go to the servers as one batched request. It may be
one function of a ``reward.fn`` list beside ordinary ones. A run whose reward.fn names one needs reward-model
servers (allocation.reward_model.workers and reward.model.path, checked before the run starts); the builtins
``hpcrl.reward.judge:llm_judge`` and ``:reward_model_score`` are such functions. An ``async def`` that names no
``reward_model``, or a plain ``def`` that names it, is refused when resolved.

A function marked with ``@in_process`` promises to be pure Python that returns in microseconds and never
hangs (``mod10`` is one): it is called in the scoring process itself, with no reward processes, no round
trip and no timeout. Anything that parses, calls out or may run long stays unmarked, in the pool. A list
is scored in the process only when every function of it is marked.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcrl.errors import UserError

RewardFn = Callable[..., Any]

EXAMPLE = "hpcrl.reward.builtin:mod10"
OWN_NAMES = ("prompt", "completion", "answer")  # what hpcrl passes; every other name is a column of the row
REWARD_MODEL = "reward_model"  # the parameter a model reward names: the reward model's client (module docstring)
_NOT_COLUMNS = (*OWN_NAMES, REWARD_MODEL)


class RewardSpecError(UserError, ValueError):
    """A reward spec cannot be resolved; the message names the spec and what failed."""


def in_process(fn: RewardFn) -> RewardFn:
    """Mark a reward function as safe to call in the scoring process (see the module's docstring)."""
    fn.hpcrl_in_process = True  # type: ignore[attr-defined]
    return fn


def runs_in_process(fn: RewardFn) -> bool:
    """Whether ``fn`` was marked with ``@in_process``."""
    return getattr(fn, "hpcrl_in_process", False) is True


@dataclass(frozen=True)
class Reward:
    """One reward function, resolved, with the names it takes (module docstring)."""

    spec: str  # "package.module:function"
    fn: RewardFn
    params: tuple[str, ...] | None  # the names it takes; None: its signature cannot be read (called positionally)
    required: tuple[str, ...]  # those without a default
    every_column: bool  # it has **kwargs: every column goes to it

    @property
    def name(self) -> str:
        """The function's name in the spec: its part's key in the metrics, ``reward/<name>``."""
        return self.spec.partition(":")[2]

    @property
    def uses_reward_model(self) -> bool:
        """A model reward: an ``async def`` that names ``reward_model``, scored in the scoring process's loop."""
        return REWARD_MODEL in (self.params or ())

    def columns(self) -> tuple[str, ...] | None:
        """The data columns it takes by name; None: every column (``**kwargs``)."""
        if self.every_column:
            return None
        return tuple(p for p in self.params or () if p not in _NOT_COLUMNS)

    def unknown(self, columns: Sequence[str]) -> list[str]:
        """Its required names that are neither hpcrl's nor in ``columns``: a call would fail on every row."""
        return [p for p in self.required if p not in _NOT_COLUMNS and p not in columns]

    def __call__(
        self, prompt: str, completion: str, answer: str, columns: Mapping[str, Any], reward_model: Any = None
    ) -> Any:
        """The function's value (a coroutine for a model reward, which takes ``reward_model``)."""
        if self.params is None:
            return self.fn(prompt, completion, answer)
        given = {**columns, "prompt": prompt, "completion": completion, "answer": answer}
        if self.uses_reward_model:
            given[REWARD_MODEL] = reward_model
        if self.every_column:
            return self.fn(**given)
        return self.fn(**{p: given[p] for p in self.params if p in given})


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


def resolve_reward(spec: str) -> Reward:
    """``resolve``, with the names the function takes read from its signature (module docstring)."""
    fn = resolve(spec)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension callable without one: the positional form
        return Reward(spec, fn, None, (), False)
    params = signature.parameters.values()
    by_position = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
    if by_position:
        raise RewardSpecError(
            f"reward function {spec!r} takes {', '.join(by_position)} by position only; a reward takes its "
            f"arguments by name ({', '.join(OWN_NAMES)}, or columns of the data): drop the '/'"
        )
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = tuple(p.name for p in named if p.default is p.empty)
    every_column = any(p.kind is p.VAR_KEYWORD for p in params)
    _check_model_reward(spec, fn, [p.name for p in named])
    return Reward(spec, fn, tuple(p.name for p in named), required, every_column)


def _check_model_reward(spec: str, fn: RewardFn, names: list[str]) -> None:
    """A model reward is an ``async def`` naming ``reward_model``; either without the other is refused."""
    is_async = inspect.iscoroutinefunction(fn)
    if is_async and REWARD_MODEL not in names:
        raise RewardSpecError(
            f"reward function {spec!r} is an async def without a {REWARD_MODEL!r} parameter: only model rewards "
            f"(async def f(prompt, completion, ..., {REWARD_MODEL})) are awaited; make it a plain def"
        )
    if REWARD_MODEL in names and not is_async:
        raise RewardSpecError(
            f"reward function {spec!r} takes {REWARD_MODEL!r} but is not an async def: a model reward awaits the "
            f"reward model, async def f(prompt, completion, ..., {REWARD_MODEL})"
        )


def specs_of(fn: str | Sequence[str]) -> list[str]:
    """``reward.fn`` as a list of specs: a string names one function."""
    return [fn] if isinstance(fn, str) else list(fn)


@dataclass(frozen=True)
class RewardFns:
    """``reward.fn`` resolved: one function, or a weighted list whose parts are kept by name."""

    rewards: tuple[Reward, ...]
    weights: tuple[float, ...]  # one per function
    listed: bool  # reward.fn was a list: each function's value is kept as a part (metrics: reward/<name>)

    @classmethod
    def resolve(cls, fn: str | Sequence[str], weights: Sequence[float] = ()) -> RewardFns:
        """Resolve every spec of ``fn``; ``RewardSpecError`` for one that does not resolve, weights that do not
        match the list, or two functions of one name (their parts would share a key)."""
        specs = specs_of(fn)
        if not specs:
            raise RewardSpecError(f"reward functions {fn!r}: the list is empty; expected one or more, e.g. {EXAMPLE!r}")
        weights = tuple(float(w) for w in weights) or (1.0,) * len(specs)
        if len(weights) != len(specs) or not all(math.isfinite(w) for w in weights):
            raise RewardSpecError(
                f"reward weights {list(weights)}: expected one finite number per function of {specs} (or none: 1 each)"
            )
        rewards = tuple(resolve_reward(spec) for spec in specs)
        names = [r.name for r in rewards]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RewardSpecError(
                f"reward functions {specs}: two are called {twice[0]!r}, and each function's part is logged under "
                "its name (reward/<name>): wrap one in a function of another name"
            )
        return cls(rewards, weights, not isinstance(fn, str))

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    @property
    def model_rewards(self) -> list[Reward]:
        """The functions that ask the reward model (``Reward.uses_reward_model``)."""
        return [r for r in self.rewards if r.uses_reward_model]

    @property
    def in_process(self) -> bool:
        """Every function is marked ``@in_process`` or is a model reward: scored in the calling process, no workers."""
        return all(runs_in_process(r.fn) or r.uses_reward_model for r in self.rewards)

    def columns(self) -> tuple[str, ...] | None:
        """The data columns the functions take, in order; None: every column (one of them has ``**kwargs``)."""
        wanted: list[str] = []
        for reward in self.rewards:
            columns = reward.columns()
            if columns is None:
                return None
            wanted += [c for c in columns if c not in wanted]
        return tuple(wanted)

    def needs(self) -> dict[str, str]:
        """The columns the functions cannot do without (a parameter without a default), each with what names it."""
        needed: dict[str, str] = {}
        for reward in self.rewards:
            for name in reward.required:
                if name not in _NOT_COLUMNS:
                    needed.setdefault(name, f"the parameter {name!r} of reward function {reward.spec!r}")
        return needed

    def combine(self, values: Sequence[float]) -> tuple[float, dict[str, float] | None]:
        """The reward of one call from each function's value, and the parts by name (None for a single ``fn``)."""
        total = math.fsum(w * v for w, v in zip(self.weights, values, strict=True))
        return total, (dict(zip(self.names, values, strict=True)) if self.listed else None)


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
