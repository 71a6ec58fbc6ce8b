import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"


def run_main(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m hpcrl.main ARGS`` as a user would, capturing its output."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.main", *args],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def main_cli(tmp_path):
    """``python -m hpcrl.main`` with run.root in a temporary directory."""

    def call(*args: str) -> subprocess.CompletedProcess:
        return run_main(*args, f"run.root={tmp_path}", cwd=tmp_path)

    return call


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Qwen2 model and character tokenizer, made once per test session."""
    from hpcrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
