"""Is the installed SGLang one hpcrl is tested with, serving every endpoint hpcrl calls?

Run by the doctor's GPU probe where the servers run (``python -m hpcrl.doctor.probe gpu``), after
``import sglang`` worked. It reads the package's metadata (the version, against ``SGLANG_REQUIREMENT``)
and its route file (``srt/entrypoints/http_server.py``, against ``ENDPOINTS``) without importing them, so
it answers in a second even where importing SGLang's server takes a minute.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from hpcrl.inference.sglang_api import HTTP_SERVER, SGLANG_REQUIREMENT, missing, routes


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
