"""The SGLang releases hpcrl is tested with, and the HTTP endpoints it calls on them.

SGLang's API moves between releases of one minor version (0.5.1 has no ``/begin_weight_update``, its
pause takes no mode), so the ``sglang`` extra names the tested release and its patch releases
(``SGLANG_REQUIREMENT``, the same string as pyproject.toml's). ``hpcrl.doctor`` checks inside a GPU job
that the installed SGLang is in that range and serves every route of ``CALLED``, read from its own
``srt/entrypoints/http_server.py`` (``routes``) without importing it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

TESTED = "0.5.23"  # the release the contract test reads its request classes from
SGLANG_REQUIREMENT = "sglang>=0.5.23,<0.5.24"  # pyproject.toml's sglang extra: 0.5.23 and its patch releases
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"  # where SGLang declares its routes, in its package

# (method, path) of every call InferenceClient makes
ENDPOINTS = (
    ("GET", "/health"),
    ("GET", "/model_info"),
    ("POST", "/generate"),
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("POST", "/flush_cache"),
    ("POST", "/abort_request"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/begin_weight_update"),
    ("POST", "/update_weights_from_distributed"),
    ("POST", "/end_weight_update"),
    ("POST", "/destroy_weights_update_group"),
    ("POST", "/load_lora_adapter"),
    ("POST", "/load_lora_adapter_from_tensors"),
    ("POST", "/unload_lora_adapter"),
    ("POST", "/update_weight_version"),
)

# the reward model's client's own (hpcrl/reward/model_client.py): a discriminative reward model's scores; its judge
# generates on /generate, above
REWARD_MODEL_ENDPOINTS = (("POST", "/classify"),)
CALLED = ENDPOINTS + REWARD_MODEL_ENDPOINTS  # every endpoint hpcrl calls on an SGLang server, as the doctor checks


def routes(source: str) -> dict[str, set[str]]:
    """{path: HTTP methods} of the FastAPI routes an SGLang ``http_server.py`` declares with a literal path:
    ``@app.get("/p")``, ``@app.post("/p")``, ``@app.api_route("/p", methods=[...])``."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            route = _route(decorator)
            if route:
                path, methods = route
                found.setdefault(path, set()).update(methods)
    return found


def missing(declared: dict[str, set[str]], wanted: Iterable[tuple[str, str]] = CALLED) -> list[str]:
    """``METHOD /path`` of each wanted endpoint that ``declared`` (from ``routes``) lacks."""
    return [f"{method} {path}" for method, path in wanted if method not in declared.get(path, set())]


def _route(decorator: ast.expr) -> tuple[str, set[str]] | None:
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
        return None
    kind = decorator.func.attr
    if (
        not decorator.args
        or not isinstance(decorator.args[0], ast.Constant)
        or not isinstance(decorator.args[0].value, str)
    ):
        return None
    path = decorator.args[0].value
    if kind in ("get", "post", "put", "delete"):
        return path, {kind.upper()}
    if kind == "api_route":
        for keyword in decorator.keywords:
            if keyword.arg == "methods" and isinstance(keyword.value, ast.List | ast.Tuple):
                return path, {
                    e.value for e in keyword.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                }
        return path, {"GET"}  # FastAPI's default
    return None
