"""SGLang's own launch parser (``ServerArgs.add_cli_args``), built from the wheel of the release hpcrl pins.

``srt/server_args.py`` imports most of SGLang's runtime (torch, zmq, CUDA kernels), so it is not imported.
The parser is built from the parts that register options, run as SGLang runs them:

- the field classes of ``_INPUT_NAMESPACES`` (``srt/arg_groups/fields/*.py``), each module run on its own, with
  SGLang's real ``arg_utils`` (stdlib and msgspec only), ``argparse_actions`` and ``choices``, its real
  ``human_readable_int`` (the type of ``--context-length``), its lists of LoRA target modules (the choices of
  ``--lora-target-modules``) and stand-ins for the other names it imports;
- SGLang's own ``add_cli_args_from_dataclass`` over each class, as ``add_cli_args`` calls it over ``ServerArgs``
  (which is assembled from exactly these classes);
- the ``parser.add_argument(...)`` statements of ``add_cli_args`` itself (dynamic choices, ``--config``, the
  deprecated spellings), each run with the stand-ins.

A change in how SGLang registers its options fails here loudly (a name that cannot be found, a shape that
is not recognised) rather than yielding a wrong list. This module holds no tests.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import decimal
import re
import sys
import types
from typing import Any

from tests.inference.sglang_wheel import PACKAGE, StandIn, Wheel

# the modules of SGLang a field module may import for real: they import only the standard library and msgspec
REAL = {
    "sglang.srt.arg_groups.arg_utils": "srt/arg_groups/arg_utils.py",
    "sglang.srt.arg_groups.argparse_actions": "srt/arg_groups/argparse_actions.py",
    "sglang.srt.arg_groups.choices": "srt/arg_groups/choices.py",
}
SERVER_ARGS = "srt/server_args.py"


class ParseError(Exception):
    """What SGLang's parser would print before exiting with status 2."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, raising instead of exiting, so a test can compare errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ParseError(message)


class _Loose(type):
    """The metaclass of stand-ins: any attribute, operator or iteration a module does at import time works."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Loose(name, (Loose,), {})

    def __iter__(cls) -> Any:
        return iter(())

    def __add__(cls, other: Any) -> Any:
        return other

    __radd__ = __or__ = __ror__ = __add__

    def __getitem__(cls, key: Any) -> Any:
        return cls

    def __len__(cls) -> int:
        return 0


class Loose(StandIn, metaclass=_Loose):
    """A name SGLang imports from its runtime: callable, iterable (empty), usable in annotations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __iter__(self) -> Any:
        return iter(())

    def __add__(self, other: Any) -> Any:
        return other

    __radd__ = __add__

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Loose(name, (Loose,), {})


class _Names(dict):
    """Locals in which a name not bound yet is a stand-in (``add_cli_args`` uses module helpers and locals)."""

    def __missing__(self, key: str) -> Any:
        if hasattr(builtins, key):
            return getattr(builtins, key)
        return _Loose(key, (Loose,), {})


def human_readable_int(wheel: Wheel) -> Any:
    """SGLang's ``--context-length`` type, run from ``srt/utils/common.py`` (which imports its runtime)."""
    source = wheel.source("srt/utils/common.py")
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "human_readable_int")
    space = {"re": re, "argparse": argparse, "Decimal": decimal.Decimal}
    exec(compile(ast.Module([node], []), "srt/utils/common.py", "exec"), space)
    return space["human_readable_int"]


def lora_targets(wheel: Wheel) -> dict[str, Any]:
    """``SUPPORTED_LORA_TARGET_MODULES`` and ``LORA_TARGET_ALL_MODULES`` of ``srt/utils/common.py`` (literals)."""
    names = ["SUPPORTED_LORA_TARGET_MODULES", "LORA_TARGET_ALL_MODULES"]
    space = wheel.assignments("srt/utils/common.py", None, names, {})
    return {name: space[name] for name in names}


def launch_parser(wheel: Wheel) -> Parser:
    """A parser holding every option ``sglang.launch_server`` accepts, registered by SGLang's own code."""
    tree = ast.parse(wheel.source(SERVER_ARGS))
    given = {"human_readable_int": human_readable_int(wheel), **lora_targets(wheel)}
    arg_utils = wheel.module(REAL["sglang.srt.arg_groups.arg_utils"])
    parser = Parser(prog="sglang serve")  # prepare_server_args's parser: argparse's defaults, -h/--help included
    for cls in _input_namespaces(tree, wheel, given):
        arg_utils.add_cli_args_from_dataclass(parser, cls)
    _run_add_argument_calls(tree, parser, wheel)
    return parser


def actions(parser: argparse.ArgumentParser) -> set[tuple[str, ...]]:
    """The option strings of each of ``parser``'s actions."""
    return {tuple(a.option_strings) for a in parser._actions if a.option_strings}


def _input_namespaces(tree: ast.Module, wheel: Wheel, given: dict[str, Any]) -> list[type]:
    """The classes of ``_INPUT_NAMESPACES``, each loaded from the module ``server_args.py`` imports it from."""
    module_of = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang.srt.arg_groups.fields."):
            module_of.update({alias.name: node.module for alias in node.names})
    listed = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["_INPUT_NAMESPACES"]
    ]
    if len(listed) != 1 or not isinstance(listed[0], ast.List):
        raise LookupError(f"{SERVER_ARGS} no longer assigns _INPUT_NAMESPACES one list: read how ServerArgs is built")
    classes = []
    for name in (ast.unparse(element) for element in listed[0].elts):
        module = _field_module(wheel, module_of[name].removeprefix("sglang.").replace(".", "/") + ".py", given)
        classes.append(getattr(module, name))
    return classes


def _field_module(wheel: Wheel, member: str, given: dict[str, Any]) -> types.ModuleType:
    name = f"{PACKAGE}.{member.removesuffix('.py').replace('/', '.')}"
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__file__ = f"{wheel.path}!sglang/{member}"
    sys.modules[name] = module  # get_type_hints resolves the string annotations in the module's namespace
    for node in ast.parse(wheel.source(member)).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            real = wheel.module(REAL[node.module]) if node.module in REAL else None
            for alias in node.names:
                value = getattr(real, alias.name) if real else given.get(alias.name, _Loose(alias.name, (Loose,), {}))
                module.__dict__[alias.asname or alias.name] = value
        else:
            exec(compile(ast.Module([node], []), module.__file__, "exec"), module.__dict__)
    return module


def _run_add_argument_calls(tree: ast.Module, parser: argparse.ArgumentParser, wheel: Wheel) -> None:
    """Run each ``parser.add_argument(...)`` of ``ServerArgs.add_cli_args`` and the assignments before them."""
    server_args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    method = next(n for n in server_args.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    first = ast.unparse(method.body[0])
    if first != "add_cli_args_from_dataclass(parser, ServerArgs)":
        raise LookupError(f"ServerArgs.add_cli_args no longer starts with the dataclass options: {first!r}")
    actions_module = wheel.module(REAL["sglang.srt.arg_groups.argparse_actions"])
    names = _Names(parser=parser, **{k: v for k, v in vars(actions_module).items() if not k.startswith("__")})
    for node in method.body[1:]:
        if isinstance(node, ast.Assign | ast.Expr):
            exec(compile(ast.Module([node], []), SERVER_ARGS, "exec"), {}, names)
