"""Errors in what the user gave or in their environment, and how an entry point reports them.

    raise UserError("the server at URL does not answer", hint="start one: python -m hpcrl.inference.server ...")

    try:                                                 # an entry point's body
        ...
    except UserError as e:
        exit_on_user_error(e, verbose=args.verbose)      # one line (and the hint), exit 2

A ``UserError`` is the user's to fix, and its message says how: a bad setting (``ConfigError``), a data file
(``DataError``), a reward or workflow that does not import (``RewardSpecError``, ``WorkflowSpecError``), a model
directory that does not load, a server that does not answer, a command that is not installed here. An entry
point prints its message as one line, ``hpcrl: <message>`` (``hpcrl: config error: ...`` for a setting), its
hint on a second line when it has one, and exits with code 2: the traceback would only bury the line. Any other
exception is a bug, and keeps its traceback. ``HYDRA_FULL_ERROR=1`` in the environment (or ``--verbose`` where an
entry point takes it) prints a user error's traceback too.

This module imports nothing of hpcrl's: every error class above derives from ``UserError``.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

EXIT_CODE = 2  # a user error's exit code, as for a bad command line (argparse) or a bad config


class UserError(Exception):
    """An error in the user's input or environment: its message is one line saying what was wrong and what was
    expected; ``hint`` (optional) what to do, when the message does not say it."""

    label = ""  # what kind of error the line calls it, e.g. "config error" (ConfigError's)

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def full_error() -> bool:
    """Whether the user asked for tracebacks of their own errors too (``HYDRA_FULL_ERROR=1``, as for Hydra's)."""
    return os.environ.get("HYDRA_FULL_ERROR", "") == "1"


def user_error_lines(e: UserError) -> list[str]:
    """What an entry point prints for ``e``: its one line, and its hint when it has one."""
    label = f"{e.label}: " if e.label else ""
    return [f"hpcrl: {label}{e}", *([f"    {e.hint}"] if e.hint else [])]


def exit_on_user_error(e: UserError, verbose: bool = False) -> NoReturn:
    """Print ``e`` as ``user_error_lines`` says (after its traceback when ``verbose`` or ``full_error()``), exit 2."""
    if verbose or full_error():
        traceback.print_exception(e)
    print("\n".join(user_error_lines(e)), file=sys.stderr, flush=True)
    sys.exit(EXIT_CODE)
