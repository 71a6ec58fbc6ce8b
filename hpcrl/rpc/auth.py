"""The run's secret token: a file of mode 0600 in the run directory, presented as a bearer token.

The controller creates it before it launches any worker; workers read it at start-up. It is written
through a temporary file created with mode 0600 (``mkstemp``) and renamed into place, so the token is
never readable by others, not even briefly. Creating it again replaces it: workers of an earlier
controller then refuse the new one, which is what a restarted run wants.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from hpcrl.rundir import write_atomic

TOKEN_FILE = "secret"


def token_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / TOKEN_FILE


def create_token(run_dir: str | Path) -> str:
    """Write a new random token to ``<run_dir>/secret`` (mode 0600) and return it."""
    path = token_path(run_dir)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"run directory {path.parent} does not exist; create the run directory first")
    token = secrets.token_urlsafe(32)
    write_atomic(path, token + "\n", mode=0o600)
    return token


def read_token(run_dir: str | Path) -> str:
    """The token in ``<run_dir>/secret``; refuses a missing, empty or group/other-accessible file."""
    path = token_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"token file {path} does not exist; the controller writes it (hpcrl.rpc.auth.create_token) "
            "before it starts workers. Is this the right run directory?"
        ) from None
    with os.fdopen(fd) as f:
        mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        if mode & 0o077:
            raise PermissionError(
                f"token file {path} has mode {mode:04o}, which lets other users read it; "
                f"expected 0600. Run: chmod 600 {path}, or start a new run"
            )
        token = f.read().strip()
    if not token:
        raise ValueError(f"token file {path} is empty; start a new run so the controller writes a fresh one")
    return token


def check(presented: str | None, expected: str) -> bool:
    """Whether the presented token is the expected one, in time independent of where they differ."""
    if presented is None or not expected:
        return False
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), expected.encode("utf-8"))
