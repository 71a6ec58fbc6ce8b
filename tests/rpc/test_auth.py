"""The token file: mode 0600 from the first byte, refused when others can read it."""

from __future__ import annotations

import os
import stat

import pytest

from hpcrl.rpc import auth


def test_token_file_is_0600_and_reads_back(tmp_path):
    token = auth.create_token(tmp_path)
    path = tmp_path / "secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(token) >= 40 and auth.read_token(tmp_path) == token
    assert auth.create_token(tmp_path) != token, "a new run gets a new token"
    assert [p.name for p in tmp_path.iterdir()] == ["secret"], "no temporary file is left behind"


def test_token_file_is_never_readable_by_others_even_with_a_lax_umask(tmp_path):
    old = os.umask(0)
    try:
        auth.create_token(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600


def test_missing_token_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "secret")):
        auth.read_token(tmp_path)
    with pytest.raises(FileNotFoundError, match="run directory"):
        auth.create_token(tmp_path / "nope")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_token_file_readable_by_others_is_refused(tmp_path, mode):
    auth.create_token(tmp_path)
    (tmp_path / "secret").chmod(mode)
    with pytest.raises(PermissionError, match=rf"{tmp_path / 'secret'} has mode {mode:04o}.*chmod 600"):
        auth.read_token(tmp_path)


def test_empty_token_file_is_refused(tmp_path):
    (tmp_path / "secret").write_text("\n")
    (tmp_path / "secret").chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        auth.read_token(tmp_path)


def test_check():
    assert auth.check("abc", "abc")
    assert not auth.check("abd", "abc")
    assert not auth.check("", "abc")
    assert not auth.check(None, "abc")
    assert not auth.check("", "")
    assert not auth.check("é\udcff", "abc"), "odd characters are a mismatch, not a crash"
