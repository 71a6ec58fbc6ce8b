"""SGLang 0.5.23's control request bodies (``srt/managers/io_struct.py``), as the CPU server checks them.

Each table lists every field of one of SGLang's request classes with the JSON type SGLang's validation
accepts, and, for a field whose other values this server cannot honour, the one value it can. A body
must be a JSON object (SGLang's routes take a required body: ``{}`` at least); a field of the wrong type
is a 400 naming it, as in SGLang; an unknown field is a 400 too, where SGLang would ignore it silently
(a misspelled ``weight_version`` would then change nothing and say so nowhere).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hpcrl.inference.server.sampling import RequestError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # the largest request body a server's app takes
_ANY = object()


@dataclass(frozen=True)
class Field:
    check: Callable[[Any], bool]  # whether a JSON value has the type SGLang's validation accepts
    expected: str  # that type, in words
    only: Any = _ANY  # the one value hpcrl's CPU server honours (SGLang's default), or any


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


STR = Field(lambda v: isinstance(v, str), "a string")
OPT_STR = Field(lambda v: v is None or isinstance(v, str), "a string or null")
BOOL = Field(lambda v: isinstance(v, bool), "true or false")
INT = Field(_is_int, "an integer")
ANY = Field(lambda v: True, "any value")
SELECTOR = Field(lambda v: v in ("target", "draft", "all"), 'one of "target", "draft", "all"')
BASE = {"rid": OPT_STR, "http_worker_ipc": OPT_STR}  # every request class of SGLang's has these

DISK = {
    **BASE,
    "model_path": STR,
    "load_format": OPT_STR,
    "abort_all_requests": BOOL,
    "weight_version": OPT_STR,
    "is_async": Field(BOOL.check, BOOL.expected, only=False),
    "torch_empty_cache": BOOL,
    "keep_pause": Field(BOOL.check, BOOL.expected, only=False),
    "recapture_cuda_graph": BOOL,
    "token_step": INT,
    "flush_cache": BOOL,
    "manifest": ANY,
}
INIT_GROUP = {
    **BASE,
    "master_address": STR,
    "master_port": INT,
    "rank_offset": INT,
    "world_size": INT,
    "group_name": STR,
    "backend": STR,
}
UPDATE_DISTRIBUTED = {
    **BASE,
    "names": Field(_list_of(lambda x: isinstance(x, str)), "a list of strings"),
    "dtypes": Field(_list_of(lambda x: isinstance(x, str)), "a list of strings"),
    "shapes": Field(_list_of(_list_of(_is_int)), "a list of lists of integers"),
    "group_name": STR,
    "flush_cache": BOOL,
    "abort_all_requests": BOOL,
    "weight_version": OPT_STR,
    "load_format": Field(OPT_STR.check, OPT_STR.expected, only=None),
    "selector": SELECTOR,
    "torch_empty_cache": BOOL,
}
BEGIN = {**BASE, "selector": SELECTOR}
END = dict(BASE)
DESTROY_GROUP = {**BASE, "group_name": STR}
WEIGHTS_BY_NAME = {**BASE, "name": STR, "truncate_size": INT}
PAUSE = {
    **BASE,
    "mode": Field(lambda v: v in ("abort", "retract", "in_place"), 'one of "abort", "retract", "in_place"'),
}
CONTINUE = {**BASE, "torch_empty_cache": BOOL}
WEIGHT_VERSION = {**BASE, "new_version": STR, "abort_all_requests": BOOL}
ABORT = {
    **BASE,
    "abort_all": BOOL,
    "finished_reason": ANY,
    "abort_message": OPT_STR,
    "weight_versions": ANY,
}


async def read_body(request: web.Request, fields: dict[str, Field]) -> dict[str, Any]:
    """The JSON object body of a control request, checked against SGLang's request class ``fields``."""
    if not request.can_read_body:
        raise RequestError(f"{request.path} needs a JSON object body ({{}} at least), as SGLang's does")
    try:
        body = await request.json()
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body of {request.path} must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise RequestError(
            f"unknown field(s) {unknown} for {request.path}; SGLang's request has {sorted(fields)} (and would ignore "
            "the others silently)"
        )
    for name, value in body.items():
        spec = fields[name]
        if not spec.check(value):
            raise RequestError(f"field {name!r} must be {spec.expected}, got {value!r}")
        if spec.only is not _ANY and value != spec.only:
            raise RequestError(f"{name}={value!r} is not supported by hpcrl's CPU server (only {spec.only!r})")
    return body


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """A ``RequestError`` raised by a route: SGLang's 400 with the message (logged)."""
    try:
        return await handler(request)
    except RequestError as e:
        log.warning("%s %s: %s", request.method, request.path, e)
        return web.json_response({"error": {"message": str(e)}}, status=400)
