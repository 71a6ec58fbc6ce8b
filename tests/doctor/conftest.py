"""``python -m hpcrl.doctor`` as a user runs it, and the Slurm fixtures for the tests marked ``slurm``."""

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.conftest import REPO
from tests.slurm.conftest import job_prefix, no_leftover_jobs, slurm_cluster  # noqa: F401 (fixtures)


@dataclass(frozen=True)
class Doctor:
    returncode: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> dict[str, str]:
        """{check: its whole line}, e.g. {"ports": "fail  ports: ...; ..."}."""
        found = {}
        for line in self.stdout.splitlines():
            status, _, rest = line.partition("  ")
            assert status.strip() in ("ok", "warn", "fail", "skip"), f"not a check line: {line!r}"
            found[rest.strip().partition(":")[0]] = line
        return found

    def status(self, check: str) -> str:
        assert check in self.lines, f"no line for {check!r}:\n{self.stdout}{self.stderr}"
        return self.lines[check].split()[0]


def run_doctor(*args: str, timeout_s: float = 180, env: dict[str, str] | None = None) -> Doctor:
    """``python -m hpcrl.doctor ARGS`` in this environment, with ``env`` over it."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "hpcrl.doctor", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    return Doctor(result.returncode, result.stdout, result.stderr)


@pytest.fixture
def weights(tmp_path):
    """A model directory holding 1 MB of weights, a config and a tokenizer file: enough to pass the config's check
    of the directory (hpcrl/config/preflight.py) and to size, nothing to load."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1_000_000)
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    return model
