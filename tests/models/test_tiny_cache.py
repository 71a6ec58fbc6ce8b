"""The tiny model cache: a copy has the bytes and modes of a fresh build, a damaged entry is rebuilt, and every
argument that changes the bytes changes the entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.models import tiny, tiny_cache

SIZES = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "characters": "0123+="}


def files(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mode & 0o777) for p in sorted(directory.iterdir())}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "hpcrl" / "tiny-models"


def no_build(*args, **kwargs):
    raise AssertionError("built the tiny model although the cache holds it")


def test_a_cached_copy_has_the_bytes_of_a_fresh_build(tmp_path, cache, monkeypatch):
    fresh = files(tiny.make_tiny_model(tmp_path / "fresh", cache=False, **SIZES))
    first = files(tiny.make_tiny_model(tmp_path / "first", **SIZES))  # builds the entry, then copies it
    monkeypatch.setattr(tiny, "_build_tiny_model", no_build)
    second = files(tiny.make_tiny_model(tmp_path / "second", **SIZES))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(fresh)
    assert first == fresh and second == fresh
    (entry,) = cache.iterdir()
    assert set(files(entry)) == {*fresh, tiny_cache.MANIFEST}


def test_a_damaged_entry_is_rebuilt(tmp_path, cache):
    fresh = files(tiny.make_tiny_model(tmp_path / "fresh", cache=False, **SIZES))
    tiny.make_tiny_model(tmp_path / "first", **SIZES)
    (entry,) = cache.iterdir()
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))  # the last parameter's last values zeroed
    assert files(tiny.make_tiny_model(tmp_path / "again", **SIZES)) == fresh
    assert files(entry)["model.safetensors"] == fresh["model.safetensors"]


@pytest.mark.parametrize("change", [{"seed": 1}, {"characters": "0123+=-"}, {"max_positions": 64}])
def test_each_argument_has_an_entry_of_its_own(tmp_path, cache, change):
    base = files(tiny.make_tiny_model(tmp_path / "base", **SIZES))
    changed = files(tiny.make_tiny_model(tmp_path / "changed", **{**SIZES, **change}))
    assert changed == files(tiny.make_tiny_model(tmp_path / "fresh", cache=False, **{**SIZES, **change}))
    assert changed != base
    assert len(list(cache.iterdir())) == 2


def test_an_unwritable_cache_builds_in_place(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails
    out = tiny.make_tiny_model(tmp_path / "m", **SIZES)
    assert files(out) == files(tiny.make_tiny_model(tmp_path / "fresh", cache=False, **SIZES))


def test_what_picks_torchs_cpu_kernels_keys_an_entry(monkeypatch):
    """The key changes with ``ATEN_CPU_CAPABILITY``: torch's kernels, and so the random fill, may change with it.
    (That the key is computed without importing torch: tests/controller/test_startup.py.)"""
    arguments, sources = {"seed": 0}, [Path(tiny_cache.__file__)]
    default = tiny_cache.entry_key(arguments, sources)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert tiny_cache.entry_key(arguments, sources) != default
