"""SGLang's own request classes, read from the wheel of the release hpcrl pins, without installing SGLang.

SGLang cannot be installed on a CPU machine (its kernels are CUDA-only), and importing
``sglang.srt.managers.io_struct`` pulls in torch, zmq and most of SGLang's runtime. So nothing is
installed or imported from the package: ``pip download --no-deps`` fetches the wheel (cached in the
temp directory), and the files are read from the zip:

- ``api/v1/api_types.py`` (only msgspec), ``srt/utils/msgspec_utils.py`` and
  ``srt/utils/field_validators.py`` run as they are, each as a module of its own, without their
  package's ``__init__``;
- ``srt/managers/io_struct.py`` is parsed, and only the request classes asked for run, with every
  module-level definition they use (type aliases, base classes); names it imports from SGLang, torch,
  numpy or zmq become stand-ins that validate as any value (they type only fields hpcrl never sends);
- ``srt/entrypoints/http_server.py`` is parsed for its routes and the request class each takes;
- ``srt/utils/common.py``'s decoder of serialized tensors runs alone, with the real torch (``tensor_decoder``);
- one function or method of any file (``Wheel.function``: ``validate_input_length``, the scheduler's
  ``init_req_max_new_tokens``, the detokenizer's ``trim_matched_stop``, ...) runs alone, with the names it
  calls given by the test, and one function's assignments (``Wheel.assignments``: ``max_req_input_len``)
  run in a namespace the test gives: SGLang's own arithmetic, without its runtime.

The classes validate as FastAPI validates an HTTP body: pydantic (``TypeAdapter``), through the schema
SGLang's own ``BaseReq.__get_pydantic_core_schema__`` gives its msgspec structs. This module holds no
tests; a wheel that cannot be fetched fails the test that needs it, naming why.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest

from hpcrl.inference.sglang_api import TESTED

CACHE = Path(tempfile.gettempdir()) / "hpcrl-sglang-wheels"
# the one platform the release is published for; pinning it makes the download the same on any machine
WHEEL_TAGS = ["--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "3.11"]
WHEEL_TAGS += ["--implementation", "cp"]
DOWNLOAD_TIMEOUT_S = 600
REAL_IMPORTS = {"__future__", "typing", "dataclasses", "enum", "collections", "copy", "logging", "uuid", "array"}
REAL_IMPORTS |= {"msgspec", "pydantic"}
PACKAGE = "sglang_wheel"  # sys.modules prefix of what is loaded here, never "sglang"


def fetch_wheel(version: str = TESTED) -> Path:
    """The wheel of sglang ``version``, downloaded once into CACHE; a test failure saying why if it cannot be."""
    found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=CACHE))  # a cut-off download never looks like a wheel in CACHE
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *WHEEL_TAGS, f"sglang=={version}", "-d", str(staging)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        wheels = sorted(staging.glob(f"sglang-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            pytest.fail(
                f"cannot fetch the sglang=={version} wheel, which the contract test reads SGLang's request classes "
                f"from (it does not skip): `{' '.join(cmd)}` exited {proc.returncode}:\n{tail}"
            )
        target = CACHE / wheels[0].name
        wheels[0].replace(target)
        return target
    except subprocess.TimeoutExpired:
        pytest.fail(f"cannot fetch the sglang=={version} wheel: `{' '.join(cmd)}` took over {DOWNLOAD_TIMEOUT_S} s")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class Wheel:
    """The files of an SGLang wheel, and the modules and classes loaded from them."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path)

    def source(self, member: str) -> str:
        return self.zip.read(f"sglang/{member}").decode()

    def module(self, member: str) -> types.ModuleType:
        """A file of the wheel run as a module of its own (its imports must be installed here)."""
        name = f"{PACKAGE}.{member.removesuffix('.py').replace('/', '.')}"
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__file__ = f"{self.path}!sglang/{member}"
            sys.modules[name] = module
            exec(compile(self.source(member), module.__file__, "exec"), module.__dict__)
        return sys.modules[name]

    def io_struct(self, wanted: list[str]) -> types.ModuleType:
        """``srt/managers/io_struct.py``'s classes ``wanted``, with the definitions they use (see the docstring)."""
        utils = self.module("srt/utils/msgspec_utils.py")
        validators = self.module("srt/utils/field_validators.py")
        given = {
            "msgspec_struct_pydantic_core_schema": utils.msgspec_struct_pydantic_core_schema,
            "Base64Bytes": utils.Base64Bytes,
            "validate_optional_list_i64_1d_2d": validators.validate_optional_list_i64_1d_2d,
        }
        member = "srt/managers/io_struct.py"
        return partial_module(
            f"{PACKAGE}.io_struct", self.source(member), f"{self.path}!sglang/{member}", wanted, given
        )

    def tensor_decoder(self) -> types.ModuleType:
        """``srt/utils/common.py``'s decoding of ``serialized_named_tensors``, run with the real io, pickle and torch:
        ``normalize_serialized_named_tensor_payloads`` (the tokenizer manager's, base64 to bytes) and
        ``MultiprocessingSerializer.deserialize`` (each tensor-parallel rank's, through ``SafeUnpickler``)."""
        import base64
        import binascii
        import io
        import pickle

        import torch

        pybase64 = types.SimpleNamespace(b64decode=base64.b64decode, b64encode=base64.b64encode)  # same signatures
        given = {"io": io, "pickle": pickle, "torch": torch, "pybase64": pybase64, "binascii": binascii}
        wanted = ["normalize_serialized_named_tensor_payloads", "MultiprocessingSerializer", "SafeUnpickler"]
        wanted.append("_safe_load_torch_storage")  # what SafeUnpickler reads torch.storage._load_from_bytes with
        member = "srt/utils/common.py"
        return partial_module(f"{PACKAGE}.common", self.source(member), f"{self.path}!sglang/{member}", wanted, given)

    def function(self, member: str, name: str, namespace: dict[str, Any], cls: str | None = None) -> Any:
        """Function ``name`` of a wheel file (a method of class ``cls`` when given), compiled alone; at call time
        it sees only ``namespace``. Decorators are dropped and annotations left unevaluated."""
        node = _definition(ast.parse(self.source(member)), name, cls, member)
        node.decorator_list = []
        space = dict(namespace)
        exec(self._compile([node], member), space)
        return space[name]

    def assignments(
        self, member: str, function: str | None, names: list[str], namespace: dict[str, Any], cls: str | None = None
    ) -> dict[str, Any]:
        """Run, in source order, the assignments to ``names`` in the body of ``function`` (of ``cls``; the file's
        top level when None) with the values ``namespace`` gives the names they read; return ``namespace``
        with the assigned values."""
        tree = ast.parse(self.source(member))
        body = tree.body if function is None else list(ast.walk(_definition(tree, function, cls, member)))
        found = [
            s
            for s in body
            if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in s.targets)
        ]
        assigned = {t.id for s in found for t in s.targets if isinstance(t, ast.Name)}
        if set(names) - assigned:
            raise LookupError(f"{member}::{function} assigns no {sorted(set(names) - assigned)}: has SGLang moved it?")
        space = dict(namespace)
        exec(self._compile(sorted(found, key=lambda s: s.lineno), member), space)
        return space

    def _compile(self, nodes: list[ast.stmt], member: str) -> Any:
        module = ast.fix_missing_locations(ast.Module(nodes, []))
        flags = __import__("__future__").annotations.compiler_flag  # annotations stay unevaluated strings
        return compile(module, f"{self.path}!sglang/{member}", "exec", flags=flags, dont_inherit=True)

    def routes(self) -> dict[str, dict[str, Any]]:
        """{path: {"methods", "body" (the request class's name or None), "required"}} of ``http_server.py``."""
        return routes_with_bodies(self.source("srt/entrypoints/http_server.py"))


class StandIn:
    """A name io_struct.py imports from SGLang's runtime (torch, zmq, ...): validates as any value."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


def partial_module(name: str, source: str, filename: str, wanted: list[str], given: dict[str, Any]) -> types.ModuleType:
    """A module holding only ``wanted`` of ``source``'s top-level definitions and what they use, in source order."""
    tree = ast.parse(source)
    defined: dict[str, ast.stmt] = {}
    imports: list[ast.stmt] = []
    for node in tree.body:
        for bound in _bound_names(node):
            defined[bound] = node
        if isinstance(node, ast.Import | ast.ImportFrom):
            imports.append(node)
    needed: set[int] = set()
    todo = list(wanted)
    while todo:
        node = defined.get(todo.pop())
        if node is None or id(node) in needed or isinstance(node, ast.Import | ast.ImportFrom):
            continue
        needed.add(id(node))
        todo += _used_names(node)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    space = module.__dict__
    for node in imports:  # the real imports of the standard library, msgspec and pydantic; stand-ins for the rest
        root = (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name or "").split(".")[0]
        if root in REAL_IMPORTS and (isinstance(node, ast.Import) or node.level == 0):
            exec(compile(ast.Module([node], []), filename, "exec"), space)
        else:
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                space[bound] = given.get(bound) or type(bound, (StandIn,), {})
    body = [node for node in tree.body if id(node) in needed]
    bound = {name for node in body for name in _bound_names(node)}
    for used in {n for node in body for n in _used_names(node)} - bound - set(space) - set(dir(builtins)):
        space[used] = type(used, (StandIn,), {})  # e.g. a name bound under ``if TYPE_CHECKING``
    exec(compile(ast.Module(body, []), filename, "exec"), space)
    missing = [w for w in wanted if w not in space]
    if missing:
        raise LookupError(f"{filename} defines no {missing}: has SGLang renamed its request classes?")
    return module


def fields_of(cls: type) -> set[str]:
    """The field names of one of SGLang's request classes (a msgspec struct or a dataclass)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import msgspec

    return {f.name for f in msgspec.structs.fields(cls)}


def routes_with_bodies(source: str) -> dict[str, dict[str, Any]]:
    from hpcrl.inference.sglang_api import routes

    declared = routes(source)
    found: dict[str, dict[str, Any]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        paths = [d.args[0].value for d in node.decorator_list if _route_path(d)]
        body, required = _body_param(node)
        for path in paths:
            found[path] = {"methods": declared[path], "body": body, "required": required}
    return found


def _route_path(decorator: ast.expr) -> bool:
    return (
        isinstance(decorator, ast.Call)
        and isinstance(decorator.func, ast.Attribute)
        and decorator.func.attr in ("get", "post", "api_route")
        and bool(decorator.args)
        and isinstance(decorator.args[0], ast.Constant)
        and isinstance(decorator.args[0].value, str)
    )


def _body_param(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str | None, bool]:
    """The request class of a route function's body parameter (``Annotated[X, Body()]``, or a class such as
    ``GenerateReqInput``), and whether it has no default (a body is required)."""
    args = function.args
    defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(args.args, defaults, strict=True):
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
            first, *extra = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            if any(isinstance(e, ast.Call) and getattr(e.func, "id", "") == "Body" for e in extra):
                return ast.unparse(first), default is None
        elif isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req")):
            return ann.id, default is None
    return None, False


def _definition(tree: ast.Module, name: str, cls: str | None, member: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The top-level function ``name`` of a parsed file, or the method ``name`` of its class ``cls``."""
    body = tree.body
    if cls is not None:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls), [])
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    raise LookupError(f"{member} defines no {cls + '.' if cls else ''}{name}: has SGLang renamed it?")


def _bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _used_names(node: ast.stmt) -> list[str]:
    """Names a definition uses when it runs: in a class, its bases, decorators, annotations and values, but
    not inside its methods (they run only when called)."""
    names: list[str] = []
    stack: list[ast.AST] = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, ast.Name):
            names.append(current.id)
        for child in ast.iter_child_nodes(current):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and current is not node:
                stack += child.decorator_list
                continue
            stack.append(child)
    return names
