"""ruff is part of the test command: lint and format are checked wherever the tests run."""

import subprocess
import sys

from tests.conftest import REPO


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_check_is_clean():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
