"""Command-line overrides, checked before Hydra composes them.

Hydra already rejects a misspelled key, but with a multi-line report and no hint; this check names
the key, its value and the keys that exist (with the closest one), in one line. It also routes the
allocation shorthand (``allocation=sglang:d4t2+fsdp:d8``) to ``allocation.spec``.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config


def expand_allocation_shorthand(argv: list[str]) -> list[str]:
    """``allocation=BACKEND:...`` is a shorthand, not a group option: route it to allocation.spec."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key == "allocation" and sep and ":" in value:
            arg = f"allocation.spec={value}"
        out.append(arg)
    return out


def check_override_keys(args: list[str], conf_dir: Path) -> None:
    """Raise ConfigError for a ``key=value`` argument whose key is not in the schema."""
    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    parser = OverridesParser.create()
    for line in candidates:
        try:
            (override,) = parser.parse_overrides([line])
        except OverrideParseException as e:
            key, _, value = line.partition("=")
            expected = (
                "a value in Hydra's override syntax: quote one that holds spaces, brackets or a leading '--' "
                f"(key='a b', key=[\"--x=1\"]); Hydra says: {str(e).splitlines()[0]}"
            )
            raise ConfigError(key, value, expected) from e
        key = override.key_or_group
        if key.split(".")[0] == "hydra" or key in groups or "/" in key or override.package is not None:
            continue
        _check_key(key, override.input_line or key)


def _check_key(key: str, line: str) -> None:
    node: typing.Any = Config
    walked = []
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return  # below a dict or list any key is allowed
        hints = typing.get_type_hints(node)
        if part not in hints:
            where = ".".join(walked) or "the root config"
            raise ConfigError(key, line.partition("=")[2], _expected(where, part, list(hints)))
        walked.append(part)
        node = hints[part]
        node = typing.get_args(node)[0] if typing.get_origin(node) is typing.Union else node


def _expected(where: str, part: str, keys: list[str]) -> str:
    close = difflib.get_close_matches(part, keys, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"a key of {where}: {hint}keys are {', '.join(keys)}"
