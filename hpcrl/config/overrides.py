"""Command-line overrides, checked before Hydra composes them, and what they imply.

Hydra already rejects a misspelled key or group option, but with a multi-line report, exit code 1 and no
hint; these checks name the key (or the group), its value and what exists (with the closest match), in one
line. ``expand_allocation_shorthand`` routes ``allocation=sglang:d4t2+fsdp:d8`` to ``allocation.spec``;
``imply_group_options`` makes ``model.path=DIR`` alone mean ``model=local``. After composition,
``check_given_keys_count`` refuses a key given on the command line that does not apply in the composed config
(``workflow.n`` while ``workflow.name`` is ``single_turn``: ``applies.RULES``), naming the option to add.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import typing
from collections.abc import Sequence
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override
from hydra.errors import OverrideParseException

from hpcrl.config.applies import refuse_given
from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config

SHORTHAND_EXAMPLE = "sglang:d4t2+fsdp:d8"


def expand_allocation_shorthand(argv: list[str]) -> list[str]:
    """``allocation=BACKEND:...`` is a shorthand, not a group option: route it to allocation.spec."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key == "allocation" and sep and ":" in value:
            arg = f"allocation.spec={value}"
        out.append(arg)
    return out


def imply_group_options(argv: list[str]) -> list[str]:
    """``model.path=DIR`` without a ``model=`` option means a local model: add ``model=local``, as a user of
    other frameworks expects (``model=tiny`` would make a tiny model and leave the path unused)."""
    keys = {arg.partition("=")[0].lstrip("+~") for arg in argv if "=" in arg and not arg.startswith("-")}
    if "model.path" in keys and "model" not in keys:
        return [*argv, "model=local"]
    return argv


def config_dirs_in(argv: Sequence[str]) -> list[Path]:
    """The directories ``--config-dir DIR`` (``-cd``) and ``--config-path`` (``-cp``) add to Hydra's search path."""
    found = []
    flags = ("--config-dir", "-cd", "--config-path", "-cp")
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if flag in flags:
            value = value if sep else (argv[i + 1] if i + 1 < len(argv) else "")
            if value:
                found.append(Path(value).expanduser().absolute())
    return found


def without_config_dirs(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--config-dir``/``--config-path`` flags and their values."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag, sep, _ = arg.partition("=")
        if flag in ("--config-dir", "-cd", "--config-path", "-cp"):
            skip = not sep
            continue
        out.append(arg)
    return out


def check_override_keys(args: list[str], conf_dir: Path, extra_dirs: Sequence[Path] = ()) -> None:
    """Raise ConfigError for a ``key=value`` argument whose key is not in the schema, or a ``group=option`` whose
    option is in no config directory (``conf_dir``, ``extra_dirs`` and any ``hydra.searchpath`` given)."""
    overrides = [_parse(a) for a in args if "=" in a and not a.startswith("-")]
    dirs = [conf_dir, *extra_dirs, *_searchpath_dirs(overrides)]
    options = group_options(dirs)
    for override in overrides:
        key = override.key_or_group
        if key in options:
            _check_option(override, key, options[key])
            continue
        if key.split(".")[0] == "hydra" or "/" in key or override.package is not None:
            continue
        _check_key(key, override.input_line or key)


def group_options(dirs: Sequence[Path]) -> dict[str, list[str]]:
    """{group: its options} over ``dirs``: every top-level folder is a group, every YAML file in it an option."""
    options: dict[str, set[str]] = {}
    for d in dirs:
        if not d.is_dir():
            continue
        for group in d.iterdir():
            if group.is_dir() and group.name != "hydra":
                options.setdefault(group.name, set()).update(p.stem for p in group.glob("*.yaml"))
    return {group: sorted(names) for group, names in options.items()}


def _parse(line: str) -> Override:
    try:
        (override,) = OverridesParser.create().parse_overrides([line])
    except OverrideParseException as e:
        key, _, value = line.partition("=")
        expected = (
            "a value in Hydra's override syntax: quote one that holds spaces, brackets or a leading '--' "
            f"(key='a b', key=[\"--x=1\"]); Hydra says: {str(e).splitlines()[0]}"
        )
        raise ConfigError(key, value, expected) from e
    return override


def _searchpath_dirs(overrides: list[Override]) -> list[Path]:
    """The local directories of a ``hydra.searchpath=[file://DIR, pkg://PACKAGE/SUB]`` override."""
    dirs = []
    for override in overrides:
        if override.key_or_group != "hydra.searchpath" or not isinstance(override.value(), list):
            continue
        for entry in override.value():
            scheme, _, where = str(entry).partition("://")
            if scheme == "file":
                dirs.append(Path(where))
            elif scheme == "pkg":
                package, _, sub = where.partition("/")
                try:
                    dirs.append(Path(str(importlib.resources.files(package).joinpath(sub))))
                except ModuleNotFoundError:
                    continue  # Hydra reports a search path it cannot read
    return dirs


def _check_option(override: Override, group: str, options: list[str]) -> None:
    value = override.value()
    if override.is_delete() or value is None:
        return  # ~experiment, experiment=null: no option
    if isinstance(value, ChoiceSweep):
        chosen = [str(v) for v in value.list]
    elif isinstance(value, str):
        chosen = [value]
    else:
        return  # glob(...), range(...): Hydra expands them against what exists
    for option in chosen:
        if option in options or option.startswith("${"):
            continue
        close = difflib.get_close_matches(option, options, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        extra = f", or a shorthand such as {SHORTHAND_EXAMPLE}" if group == "allocation" else ""
        raise ConfigError(group, option, f"an option of {group}: {hint}options are {', '.join(options)}{extra}")


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


def check_given_keys_count(overrides: Sequence[str], cfg: Config) -> None:
    """Raise ConfigError for a key given in ``overrides`` that does not apply in ``cfg`` (``applies.RULES``), naming
    the option that makes it count."""
    given = {}
    for arg in overrides:
        if "=" in arg and not arg.startswith(("-", "~")):
            override = _parse(arg)
            given[override.key_or_group] = override.value()
    refuse_given(given, cfg, launcher_option())


def launcher_option() -> str | None:
    """The ``hydra/launcher`` option of the running Hydra app (basic, submitit_slurm, ...); None outside one, or
    where Hydra has not said it yet (a sweep's check before its launch): then ``applies`` reports nothing it decides."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("hydra/launcher")
