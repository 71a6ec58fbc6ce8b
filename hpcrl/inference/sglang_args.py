"""``inference.extra_args`` read as SGLang reads its command line, and refused when it cannot work in a run.

SGLang parses ``sglang.launch_server``'s arguments with argparse: an option may be shortened to any prefix that
no other option shares (``--context-len 4096`` sets ``--context-length``; ``--d 2`` is ambiguous, an error), and
the last of a repeated option wins. ``launch_args`` parses the extra arguments with a parser holding every
option string of SGLang 0.5.23's (``sglang_flags.ACTIONS``), so each abbreviation means here what it means to
SGLang, and refuses, before any server starts (``ConfigError`` on ``inference.extra_args``):

- the options hpcrl passes itself (``MANAGED``): SGLang would keep whichever comes last;
- SGLang's LoRA options that hpcrl passes itself when ``train.lora.rank`` > 0 (``LORA_MANAGED``), and
  ``--lora-paths``: refused with LoRA off too, where hpcrl's requests name no adapter, so that an adapter or
  LoRA buffers SGLang would set up serve nothing;
- data-parallel replicas (``--dp-size`` above 1 without ``--enable-dp-attention``) and pipeline stages
  (``--pp-size`` above 1), with either weight sync: SGLang would start ``dp x pp x tp_size`` GPUs' ranks, and a
  server worker owns ``allocation.server.tp_size`` GPUs. With ``train.weight_sync=distributed`` SGLang also
  refuses to form the weight-update group with replicas (``dp_size == 1`` is asserted), and the ranks of
  pipeline stages would collide in it (each joins as ``rank_offset + tp_rank``). Attention data parallelism
  (``--attn-dp-size N``, or ``--dp-size N --enable-dp-attention``) runs inside the tensor-parallel group on
  the same GPUs and ranks, and is passed on;
- ``--config`` (options from a YAML file, which hpcrl cannot check) and ``--help`` (SGLang prints it and exits);
- an EAGLE-family ``--speculative-algorithm`` whose draft sizes hpcrl cannot know (below).

It also reads what decides the context the server enforces (``LaunchArgs``, used by ``context.context_length``):
``--context-length`` (SGLang's sizes: ``32k``, ``4Ki``), else ``--json-model-override-args`` applied to the
model's ``config.json``, and the output slots EAGLE-family algorithms (EAGLE, EAGLE3, NEXTN, FROZEN_KV_MTP)
hold in every request for draft tokens: SGLang refuses a request when prompt + those slots fill the context,
or prompt + slots + ``max_new_tokens`` exceed it, the slots being ``max(eagle_topk x num_steps,
num_draft_tokens)``. SGLang chooses the three sizes per model when they are not given, and
``--speculative-adaptive`` changes them while it runs, so hpcrl asks for all three and no adaptive mode.

Options that SGLang 0.5.23 does not have are passed on as they are, for SGLang to judge.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

from hpcrl.config.errors import ConfigError
from hpcrl.inference.context import context_of_config
from hpcrl.inference.sglang_flags import ACTIONS

FIELD = "inference.extra_args"

# The options hpcrl sets from the config -> the setting to change instead
MANAGED: dict[str, str] = {
    "--model-path": "model.path / model.source",
    "--host": "cluster.net.bind_host",
    "--port": "cluster.net.port_min / port_max",
    "--tp-size": "allocation.server.tp_size",
    "--mem-fraction-static": "inference.mem_fraction_static",
    "--dtype": "model.dtype",
    "--random-seed": "run.seed",
    "--max-running-requests": "inference.max_running_requests",
    # from the server worker's own port slot, free on its node; a fixed port would collide on a shared node
    "--nccl-port": "cluster.net.port_min / port_max",
}
# SGLang's LoRA options that hpcrl sets from train.lora (sglang.lora_args), or that would load an adapter no request
# of the run names -> what to do instead
LORA_MANAGED: dict[str, str] = {
    "--enable-lora": "set train.lora.rank > 0 instead",
    "--max-lora-rank": "set train.lora.rank instead",
    "--lora-target-modules": "set train.lora.target_modules instead",
    "--max-loras-per-batch": "hpcrl sizes it for the current adapter, the previous one during an update and the base",
    "--lora-paths": "an adapter loaded at start-up would serve no request of the run",
}
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN", "FROZEN_KV_MTP")  # SGLang upper-cases the name; NEXTN is EAGLE's alias
DRAFT_SIZES = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")

_SIZE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_MULTIPLIER = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def human_readable_int(text: str) -> int:
    """A size as SGLang's ``--context-length`` takes it: an integer, or a number with a case-sensitive suffix,
    SI (``k M G T``, decimals allowed: ``25.6k`` is 25600, rounded down) or IEC (``Ki Mi Gi Ti``, integers only:
    ``4Ki`` is 4096)."""
    text = text.strip()
    match = _SIZE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer, nor one such as 32k or 4Ki") from None
    number, suffix = match.groups()
    if suffix.endswith("i") and "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: an IEC suffix ({suffix}) takes an integer, such as 4{suffix}")
    return int(Decimal(number) * _MULTIPLIER[suffix])


# The options read here -> how SGLang takes their value (an option's other spellings come from ACTIONS)
_READ: dict[str, dict[str, Any]] = {
    "--context-length": {"type": human_readable_int},
    "--json-model-override-args": {},
    "--dp-size": {"type": int},
    "--attn-dp-size": {"type": int},
    "--enable-dp-attention": {"action": "store_const", "const": True},
    "--pp-size": {"type": int},
    "--speculative-algorithm": {},
    "--speculative-num-steps": {"type": int},
    "--speculative-eagle-topk": {"type": int},
    "--speculative-num-draft-tokens": {"type": int},
    "--speculative-adaptive": {"action": "store_const", "const": True},
    "--config": {},
    "-h": {"action": "store_const", "const": True},
    **{flag: {} for flag in MANAGED},  # refused whatever the value, so any value parses
    "--enable-lora": {"action": "store_const", "const": True},
    "--max-lora-rank": {},
    "--lora-target-modules": {"nargs": "*"},
    "--max-loras-per-batch": {},
    "--lora-paths": {"nargs": "*"},
}
_SPELLINGS = {strings[0]: strings for strings in ACTIONS}
_ALL_SPELLINGS = frozenset(s for strings in ACTIONS for s in strings)


@dataclass(frozen=True)
class LaunchArgs:
    """What ``inference.extra_args`` tell SGLang about the context it enforces."""

    context_length: int | None = None  # --context-length; None: the model's config.json
    model_override: dict[str, Any] = field(default_factory=dict)  # --json-model-override-args
    reserved_tokens: int = 0  # output slots of every request held for speculative draft tokens


def check_extra_args(extra_args: Sequence[str], backend: str) -> None:
    """``validate``'s check of ``inference.extra_args``: with SGLang servers they must pass ``launch_args``
    (the cpu server takes none: a run says so, or refuses them given on the command line, ``config.applies``)."""
    if backend == "sglang":
        launch_args(extra_args)


def served_context(model_path: str | Path, extra_args: Sequence[str]) -> int:
    """The context a request (prompt + ``max_new_tokens``) has on an SGLang server of ``model_path`` started with
    ``extra_args``: ``--context-length`` as SGLang parses it, else the model's ``config.json`` with
    ``--json-model-override-args`` applied (as ``context.context_of_config`` reads it), less the slots held for
    speculative draft tokens."""
    launch = launch_args(extra_args)
    context = launch.context_length
    if context is None:
        path = Path(model_path) / "config.json"
        try:
            config = overridden(json.loads(path.read_text()), launch.model_override)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the model's context length from {path}: {e}") from e
        context = context_of_config(config.get("text_config") or config)
    return context - launch.reserved_tokens


def overridden(config: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``config`` with SGLang's ``--json-model-override-args`` applied: each key set, except that a dict given for
    a dict (a sub-config such as ``text_config``, or ``rope_scaling``) is merged into it, as SGLang does."""
    merged = dict(config)
    for key, value in override.items():
        current = merged.get(key)
        merged[key] = {**current, **value} if isinstance(value, dict) and isinstance(current, dict) else value
    return merged


def launch_args(extra_args: Sequence[str]) -> LaunchArgs:
    """``extra_args`` parsed as SGLang 0.5.23 parses them; ``ConfigError`` naming the option and why when
    they hold something hpcrl refuses (see the module's docstring)."""
    args = list(extra_args)
    _check_items(args)
    try:
        parsed, _ = _parser().parse_known_args(args)  # what SGLang 0.5.23 does not know is SGLang's to judge
    except _ParseError as e:
        _refuse(args, f"options SGLang's launch parser accepts ({e})")
    given = {flag: value for flag in _READ if (value := getattr(parsed, _dest(flag))) is not None}
    _check_refused(args, given)
    _check_parallelism(args, given)
    return LaunchArgs(
        context_length=given.get("--context-length"),
        model_override=_model_override(args, given),
        reserved_tokens=_reserved_tokens(args, given),
    )


class _ParseError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's prints the usage and exits
        raise _ParseError(message)


@cache
def _parser() -> _Parser:
    parser = _Parser(prog="sglang.launch_server", add_help=False)  # -h/--help is one of ACTIONS
    for strings in ACTIONS:
        # every option is added, those hpcrl does not read too, so that an abbreviation matches what it matches
        # in SGLang (or is as ambiguous); their values are taken whatever their number
        how = _READ.get(strings[0], {"nargs": "*"})
        parser.add_argument(*strings, dest=_dest(strings[0]), default=None, **how)
    return parser


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _written(args: list[str], flag: str) -> str:
    """``flag`` as ``args`` spell it (the last time), e.g. ``--pp (--pp-size)`` for an abbreviation."""
    spellings = _SPELLINGS[flag]
    for item in reversed(args):
        option = item.split("=", 1)[0]
        abbreviated = option.startswith("--") and len(option) > 2 and option not in _ALL_SPELLINGS
        if option in spellings or (abbreviated and any(s.startswith(option) for s in spellings)):
            named = next(s for s in spellings if s.startswith("--"))  # -h is --help
            return option if option == named else f"{option} ({named})"
    return flag


def _check_items(args: list[Any]) -> None:
    for item in args:
        if not isinstance(item, str):
            _refuse(args, f"strings, one argv element each (got {item!r})")
        option = item.split("=", 1)[0]
        if item.startswith("--") and any(c.isspace() for c in option):
            _refuse(
                args,
                f"one argv element per item: {item!r} holds a flag and a value; write them as two items "
                f"['{option.split()[0]}', '...'] or as '--flag=value'",
            )


def _check_refused(args: list[str], given: dict[str, Any]) -> None:
    for flag, setting in MANAGED.items():
        if flag in given:
            written = _written(args, flag)
            _refuse(
                args,
                f"no {written}: hpcrl passes {flag} to SGLang itself, and SGLang would silently keep the last one; "
                f"set {setting} instead",
            )
    for flag, instead in LORA_MANAGED.items():
        if flag in given:
            _refuse(
                args,
                f"no {_written(args, flag)}: hpcrl passes SGLang's LoRA options itself when train.lora.rank > 0 and "
                f"loads the adapter it trains, which its requests name; {instead}",
            )
    if "-h" in given:
        _refuse(args, f"no {_written(args, '-h')}: SGLang would print its help and exit instead of serving")
    if "--config" in given:
        _refuse(
            args,
            f"no {_written(args, '--config')}: hpcrl cannot check the options a config file sets (the context "
            f"length, parallelism, the flags hpcrl passes); write them in {FIELD}",
        )


def _check_parallelism(args: list[str], given: dict[str, Any]) -> None:
    dp, attn_dp = given.get("--dp-size", 1), given.get("--attn-dp-size", 1)
    if given.get("--enable-dp-attention") and attn_dp == 1:
        dp = 1  # the deprecated spelling of --attn-dp-size: SGLang moves --dp-size there
    if dp > 1:
        _refuse(
            args,
            f"no {_written(args, '--dp-size')} {dp} (data-parallel replicas): SGLang would need {dp} x tp_size "
            "GPUs, but a server worker owns allocation.server.tp_size GPUs, and SGLang's distributed weight update "
            "refuses replicas; for more replicas raise allocation.server.workers, for attention data parallelism "
            "inside the tensor-parallel group use --attn-dp-size",
        )
    pp = given.get("--pp-size", 1)
    if pp > 1:
        _refuse(
            args,
            f"no {_written(args, '--pp-size')} {pp} (pipeline stages): SGLang would need {pp} x tp_size GPUs, but "
            "a server worker owns allocation.server.tp_size GPUs, and in the distributed weight update every stage "
            "would join with the same ranks (rank_offset + tp_rank); raise allocation.server.tp_size instead",
        )


def _model_override(args: list[str], given: dict[str, Any]) -> dict[str, Any]:
    text = given.get("--json-model-override-args", "{}")
    try:
        override = json.loads(text)
    except ValueError as e:
        _refuse(args, f"a JSON object after --json-model-override-args (SGLang reads it with json.loads: {e})")
    if not isinstance(override, dict):
        _refuse(args, f"a JSON object after --json-model-override-args, not a {type(override).__name__}")
    return override


def _reserved_tokens(args: list[str], given: dict[str, Any]) -> int:
    algorithm = given.get("--speculative-algorithm")
    if algorithm is None or algorithm.upper() not in EAGLE_FAMILY:
        return 0  # SGLang's other algorithms hold no output slots of the request
    why = f"--speculative-algorithm {algorithm} holds max(topk x steps, draft tokens) output slots of each request"
    if given.get("--speculative-adaptive"):
        _refuse(args, f"no --speculative-adaptive: {why}, and the adaptive mode changes the steps while it runs")
    missing = [flag for flag in DRAFT_SIZES if flag not in given]
    if missing:
        _refuse(
            args,
            f"{', '.join(missing)} given too: {why}, which hpcrl's context check must know, and without them SGLang "
            "chooses the sizes per model",
        )
    steps, topk, drafts = (given[flag] for flag in DRAFT_SIZES)
    return max(topk * steps, drafts)


def _refuse(args: list[Any], expected: str) -> NoReturn:
    raise ConfigError(FIELD, args, expected)
