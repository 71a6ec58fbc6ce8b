"""Plug-in workflows: ``workflow.name="package.module:function"`` (or ``:Class``), resolved by import.

Each process that runs episodes (the controller, or each rollout worker) imports the module by name, as reward
functions are imported (``hpcrl/reward/registry.py``): nothing is pickled, so a function defined in ``__main__``
cannot be named. The controller resolves it before any worker starts, so a name that does not import fails the
run at once, naming the module. What it must be: ``base.py``'s episode contract, an async function of an
``EpisodeContext``, or a class whose instances are (built once per process, with no arguments).
"""

from __future__ import annotations

import inspect
from typing import Any

from hpcrl.errors import UserError
from hpcrl.reward.registry import import_named
from hpcrl.rollout.workflows.base import EpisodeFn

EXAMPLE = "hpcrl.rollout.agents.mod10:calculator_agent"


class WorkflowSpecError(UserError, ValueError):
    """A plug-in workflow cannot be resolved; the message names the spec and what failed."""


def is_plugin(name: str) -> bool:
    """Whether ``workflow.name`` names a plug-in (``module:attr``) rather than a built-in workflow."""
    return ":" in name


def resolve(spec: str) -> EpisodeFn:
    """The episode function ``spec`` names (a class is instantiated); ``WorkflowSpecError`` if that fails."""
    module_name, attr = _split(spec)
    named, importers = f"workflow.name={spec!r}", "every process that runs episodes"
    target = import_named(module_name, attr, named, WorkflowSpecError, importers)
    episode = _instance(spec, target) if inspect.isclass(target) else target
    call = episode if inspect.isfunction(episode) else inspect.getattr_static(type(episode), "__call__", None)
    if not inspect.iscoroutinefunction(call):
        raise WorkflowSpecError(
            f"workflow.name={spec!r}: {module_name}.{attr} is not an async function; expected "
            "`async def episode(ep: EpisodeContext) -> float | None` (hpcrl/rollout/workflows/base.py)"
        )
    return episode


def extra_text(episode: Any) -> list[str]:
    """The text an episode says it puts into conversations (its ``text`` attribute), for a tiny model's alphabet."""
    text = getattr(episode, "text", ())
    return [text] if isinstance(text, str) else [str(t) for t in text]


def _instance(spec: str, cls: type) -> Any:
    try:
        return cls()
    except Exception as e:
        raise WorkflowSpecError(
            f"workflow.name={spec!r}: the class {cls.__name__} could not be built with no arguments: "
            f"{type(e).__name__}: {e}"
        ) from e


def _split(spec: str) -> tuple[str, str]:
    module_name, sep, attr = spec.partition(":")
    ok = bool(sep) and all(part.isidentifier() for part in [*module_name.split("."), attr])
    if not ok:
        raise WorkflowSpecError(
            f"workflow.name={spec!r} is not of the form 'package.module:function', e.g. {EXAMPLE!r}"
        )
    if module_name in ("__main__", "__mp_main__"):
        raise WorkflowSpecError(
            f"workflow.name={spec!r}: a function in __main__ cannot be imported by the processes that run episodes; "
            "move it into a module and name it as 'package.module:function'"
        )
    return module_name, attr
