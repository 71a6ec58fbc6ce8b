"""Is the installed SGLang one hpcrl is tested with, serving every endpoint hpcrl calls?

Run by the doctor's GPU probe where the servers run (``python -m hpcrl.doctor.probe gpu``), after
``import sglang`` worked. It reads the package's metadata (the version, against ``SGLANG_REQUIREMENT``)
and its route file (``srt/entrypoints/http_server.py``, against ``CALLED``) without importing them, so
it answers in a second even where importing SGLang's server takes a minute.

Where ``import sglang`` fails, ``install_problems`` says whether the tested release can be installed there at
all: it publishes wheels only (no source package) for Linux with glibc >= 2.34 on x86_64 and aarch64, and its
dependencies all have wheels only for CPython 3.11 and 3.12.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from hpcrl.inference.sglang_api import HTTP_SERVER, SGLANG_REQUIREMENT, TESTED, missing, routes

# Where sglang 0.5.23 installs from wheels, as pip resolves it from PyPI: its own wheels are cp311/cp312/cp313
# manylinux_2_34 (x86_64, aarch64), with no source package; on 3.13 outlines_core 0.1.26 (the pin of its
# outlines==0.1.11) has no wheel, only a Rust source package that pip would have to build.
INSTALLABLE_PYTHONS = ((3, 11), (3, 12))
INSTALLABLE_MACHINES = ("x86_64", "aarch64")
MIN_GLIBC = (2, 34)


def sglang_status(search_path: list[str] | None = None) -> dict[str, Any]:
    """{"ok": bool, "detail": text} for the SGLang installed on ``search_path`` (None: this Python's)."""
    path = sys.path if search_path is None else search_path
    found = list(importlib.metadata.distributions(name="sglang", path=path))
    if not found:
        return {"ok": False, "detail": "sglang is not installed (no package metadata)"}
    dist = found[0]
    version, tested = dist.version, Requirement(SGLANG_REQUIREMENT).specifier
    if not tested.contains(version, prereleases=True):
        return {
            "ok": False,
            "detail": f"sglang {version} is not in the range hpcrl is tested with ({tested}): its HTTP API differs "
            f"(0.5.1 has no /begin_weight_update, its pause no mode); install '{SGLANG_REQUIREMENT}'",
        }
    route_file = Path(str(dist.locate_file(HTTP_SERVER)))
    try:
        declared = routes(route_file.read_text())
    except (OSError, SyntaxError) as e:
        return {"ok": False, "detail": f"sglang {version}: cannot read its routes from {route_file}: {e}"}
    absent = missing(declared)
    if absent:
        return {"ok": False, "detail": f"sglang {version} does not serve {', '.join(absent)}, which hpcrl calls"}
    return {"ok": True, "detail": f"sglang {version} (tested: {tested}), serving every endpoint hpcrl calls"}


def install_problems(
    python: tuple[int, ...] | None = None, machine: str | None = None, libc: tuple[str, str] | None = None
) -> list[str]:
    """What keeps sglang TESTED from installing on a machine with ``python`` (version_info), ``machine``
    (platform.machine()) and ``libc`` (platform.libc_ver(): ("glibc", "2.36"), or ("", "") without glibc); each
    None: this machine's. Empty when it installs."""
    python = sys.version_info[:2] if python is None else tuple(python[:2])
    machine = platform.machine() if machine is None else machine
    name, version = platform.libc_ver() if libc is None else libc
    problems = []
    if python not in INSTALLABLE_PYTHONS:
        wanted = " or ".join(".".join(map(str, v)) for v in INSTALLABLE_PYTHONS)
        problems.append(f"Python {'.'.join(map(str, python))} (needs {wanted})")
    if machine not in INSTALLABLE_MACHINES:
        problems.append(f"{machine or 'an unknown machine'} (needs {' or '.join(INSTALLABLE_MACHINES)})")
    glibc = ".".join(map(str, MIN_GLIBC))
    if name != "glibc":
        problems.append(f"no glibc (needs glibc >= {glibc})")
    elif _version_tuple(version) < MIN_GLIBC:
        problems.append(f"glibc {version} (needs >= {glibc})")
    return problems


def install_status(problems: list[str]) -> dict[str, Any] | None:
    """The probe's sglang part when ``problems`` (``install_problems``) keep it from installing; None when none."""
    if not problems:
        return None
    return {
        "ok": False,
        "detail": f"sglang {TESTED} cannot be installed here: {', '.join(problems)}",
        "advice": f"sglang {TESTED} publishes only wheels, for CPython 3.11/3.12 on Linux x86_64/aarch64 with "
        "glibc >= 2.34: run the servers on such nodes, or in a container image that has them",
    }


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)
