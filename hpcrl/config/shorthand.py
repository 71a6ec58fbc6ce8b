"""The allocation shorthand: a whole allocation on one line.

    SPEC  := ROLE ( "+" ROLE )*
    ROLE  := BACKEND ":" FIELD+ | "rm:" SERVER_BACKEND ":" FIELD+
    FIELD := d<N> workers | t<N> tensor-parallel size | g<N> GPUs per worker | n<N> nodes

The backend names the role: ``cpu`` and ``sglang`` are inference servers, ``fsdp`` is the trainer, and
``critic`` is the value model of ``algorithm.advantage=gae`` (FSDP ranks, like the trainer's; optional).
Examples: ``sglang:d4t2+fsdp:d8`` (4 SGLang servers of 2 GPUs each, 8 FSDP ranks of 1 GPU),
``cpu:d1+fsdp:d2g0`` (1 CPU server, 2 trainer ranks on CPU), ``sglang:d8t2n2+fsdp:d16n2``,
``sglang:d4t2+fsdp:d8+critic:d4`` (and a critic of 4 FSDP ranks).

``rm:`` names the reward model's servers (``allocation.reward_model``, optional), then their server backend:
``cpu:d1+fsdp:d2g0+rm:cpu:d1`` (and one CPU server of ``reward.model.path``), ``sglang:d4t2+fsdp:d8+rm:sglang:d2t2``
(and 2 SGLang reward-model servers of 2 GPUs each).
"""

from __future__ import annotations

import re

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import SERVER_BACKENDS, TRAINER_BACKENDS, RoleAllocation

FORM = (
    "BACKEND:FIELDS[+BACKEND:FIELDS][+critic:FIELDS][+rm:BACKEND:FIELDS], FIELDS from d<workers> t<tp> "
    "g<gpus/worker> n<nodes>, e.g. sglang:d4t2+fsdp:d8"
)
CRITIC = "critic"  # the critic's role, and its name in the shorthand (its backend is fsdp)
REWARD_MODEL = "reward_model"  # the reward model's servers: "rm:" then a server backend in the shorthand
RM_PREFIX = "rm"
_FIELDS = {"d": "workers", "t": "tp_size", "g": "gpus_per_worker", "n": "nodes"}
_FIELD_RE = re.compile(r"([a-z])(\d+)")


def role_of(backend: str) -> str | None:
    """The role a backend serves, or None for an unknown backend."""
    if backend in SERVER_BACKENDS:
        return "server"
    if backend in TRAINER_BACKENDS:
        return "trainer"
    return CRITIC if backend == CRITIC else None


def parse_spec(spec: str) -> dict[str, RoleAllocation]:
    """Parse a shorthand into one RoleAllocation per role (the critic's and the reward model's only when named);
    ConfigError names the bad part."""
    roles: dict[str, RoleAllocation] = {}
    for part in spec.strip().split("+"):
        role, alloc = _parse_role(spec, part.strip())
        if role in roles:
            _fail(spec, part, f"a second {role} (one backend per role)")
        roles[role] = alloc
    for role in ("server", "trainer"):
        if role not in roles:
            _fail(spec, spec, f"a {role} role ({'|'.join(_backends(role))})")
    return roles


def format_spec(roles: dict[str, RoleAllocation]) -> str:
    """The shorthand of an allocation (inverse of parse_spec for resolved allocations); a critic or a reward model
    without workers is left out."""
    parts = []
    for role in ("server", "trainer", CRITIC, REWARD_MODEL):
        a = roles.get(role)
        if a is None or (role in (CRITIC, REWARD_MODEL) and not a.workers):
            continue
        text = f"{_prefix(role, a.backend)}:d{a.workers}"
        if a.tp_size != 1:
            text += f"t{a.tp_size}"
        if a.gpus_per_worker is not None:
            text += f"g{a.gpus_per_worker}"
        if a.nodes:
            text += f"n{a.nodes}"
        parts.append(text)
    return "+".join(parts)


def _prefix(role: str, backend: str) -> str:
    """How a role's part of the shorthand begins: its backend, ``critic``, or ``rm:`` and its backend."""
    if role == CRITIC:
        return CRITIC
    return f"{RM_PREFIX}:{backend}" if role == REWARD_MODEL else backend


def _parse_role(spec: str, part: str) -> tuple[str, RoleAllocation]:
    backend, sep, fields = part.partition(":")
    if backend == RM_PREFIX and sep:  # the reward model's servers: rm:BACKEND:FIELDS, BACKEND a server's
        backend, sep, fields = fields.partition(":")
        if not sep or backend not in SERVER_BACKENDS:
            _fail(spec, part, f"rm: then a server backend among {', '.join(SERVER_BACKENDS)} then ':'")
        return REWARD_MODEL, _parse_fields(spec, part, backend, fields)
    role = role_of(backend)
    if not sep or role is None:
        choices = ", ".join((*SERVER_BACKENDS, *TRAINER_BACKENDS, CRITIC, f"{RM_PREFIX}:<server backend>"))
        _fail(spec, part, f"a backend among {choices} then ':'")
    return role, _parse_fields(spec, part, "fsdp" if role == CRITIC else backend, fields)


def _parse_fields(spec: str, part: str, backend: str, fields: str) -> RoleAllocation:
    """The RoleAllocation of ``backend`` with ``fields`` (d4t2...) set."""
    alloc = RoleAllocation(backend=backend)
    if not fields or _FIELD_RE.sub("", fields):
        _fail(spec, part, "fields like d4t2 after the ':'")
    seen = set()
    for letter, number in _FIELD_RE.findall(fields):
        if letter not in _FIELDS or letter in seen:
            _fail(spec, part, f"each of {', '.join(_FIELDS)} at most once")
        seen.add(letter)
        setattr(alloc, _FIELDS[letter], int(number))
    if "d" not in seen:
        _fail(spec, part, "a worker count d<N>")
    return alloc


def _backends(role: str) -> tuple[str, ...]:
    return SERVER_BACKENDS if role == "server" else TRAINER_BACKENDS


def _fail(spec: str, part: str, expected: str) -> None:
    raise ConfigError("allocation.spec", spec, f"{expected} in {part!r}; the form is {FORM}")
