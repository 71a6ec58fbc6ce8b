"""A per-user cache of generated tiny models, so a job (or a test) does not rebuild the same bytes each time.

Building a tiny model costs a process several seconds of CPU, most of it importing transformers' Qwen2 modules
(which pull in ``torch.distributed.tensor`` and ``torch._dynamo``) only to initialise 0.5M parameters; a cached
copy costs milliseconds. An entry is keyed by everything that decides the files' bytes: the builder's
arguments, the source of the modules that write them (``tiny.py``, ``tokenizer.py``), the versions of the
libraries that initialise and serialise (torch, transformers, tokenizers, safetensors), the machine and what
decides the CPU kernels torch picks (its random normal fill has a vectorised path per instruction set): the CPU's
feature flags and ``ATEN_CPU_CAPABILITY``, read without importing torch, so that a job whose tiny model is cached
imports torch only once its workers are starting. An entry is written
whole into a temporary directory and renamed into place, so a reader sees all of it or nothing; its manifest
holds every file's SHA-256, checked on each copy out (a damaged entry is rebuilt, not used).

The cache lives in ``$XDG_CACHE_HOME/hpcrl/tiny-models`` (``~/.cache/hpcrl/tiny-models`` without it); a cache
that cannot be written (a read-only home) only costs the rebuild.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")  # they initialise and write the files' bytes
MANIFEST = ".hpcrl-manifest.json"  # in each entry: file name -> SHA-256, written last


def cache_root() -> Path:
    """Where entries live: ``$XDG_CACHE_HOME/hpcrl/tiny-models``, else ``~/.cache/hpcrl/tiny-models``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hpcrl" / "tiny-models"


def entry_key(arguments: dict[str, Any], sources: list[Path]) -> str:
    """The SHA-256 of everything that decides a built model's bytes (see the module docstring)."""
    facts = {
        "arguments": arguments,
        "sources": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sources},
        "libraries": {name: version(name) for name in LIBRARIES},
        "machine": platform.machine(),
        "cpu": cpu_features(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def cpu_features() -> str:
    """What torch picks its CPU kernels by: ``ATEN_CPU_CAPABILITY`` and the CPU's feature flags (``/proc/cpuinfo``'s
    first ``flags`` line; the processor's name where there is none). Finer than torch's own capability name, so an
    entry is never shared across what would pick different kernels."""
    flags = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("flags")), flags)
    return f"{os.environ.get('ATEN_CPU_CAPABILITY', '')}|{hashlib.sha256(flags.encode()).hexdigest()}"


def copy_or_build(out: Path, key: str, build: Callable[[Path], object]) -> Path:
    """Fill ``out`` with the files of entry ``key``, building the entry with ``build(directory)`` if missing."""
    entry = cache_root() / key
    if not _intact(entry):
        try:
            _add(entry, build)
        except OSError as e:  # the cache cannot be written: build where the model is wanted, as without it
            log.warning("tiny model cache %s not writable (%s): building the model in %s", entry.parent, e, out)
            build(out)
            return out
    out.mkdir(parents=True, exist_ok=True)
    for name in _manifest(entry):
        shutil.copy2(entry / name, out / name)  # with its mode: model.safetensors is written 0600
    return out


def _add(entry: Path, build: Callable[[Path], object]) -> None:
    """Build into a temporary directory beside ``entry``, record its manifest, rename it into place."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}."))
    try:
        build(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MANIFEST).write_text(json.dumps({name: _sha256(tmp / name) for name in files}, indent=1))
        if entry.exists():  # damaged (not _intact): replaced by the new build
            shutil.rmtree(entry)
        try:
            tmp.rename(entry)
        except OSError:  # another process renamed its build in first: the same bytes
            if not _intact(entry):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _intact(entry: Path) -> bool:
    """Whether ``entry`` holds a manifest and every file it lists, with the recorded SHA-256."""
    try:
        return all(_sha256(entry / name) == digest for name, digest in _manifest(entry).items())
    except (OSError, ValueError):
        return False


def _manifest(entry: Path) -> dict[str, str]:
    return json.loads((entry / MANIFEST).read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
