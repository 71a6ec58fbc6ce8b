"""``python -m hpcrl.inference.server`` started by hand (docs/agents.md) with a model directory that is not one:
one line and a hint, exit code 2 (``hpcrl.errors``)."""

import shutil
import subprocess
import sys

from tests.conftest import REPO, user_error


def serve(model) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpcrl.inference.server", "--model-path", str(model), "--port", "1"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_model_path_that_is_no_directory_is_one_line(tmp_path):
    # before: 76 lines of tracebacks ending in huggingface_hub's "Repo id must be in the form ..."
    line, hint = user_error(serve(tmp_path / "missing"))
    assert line == f"hpcrl: --model-path {tmp_path / 'missing'} is not a directory"
    assert "nothing is downloaded" in hint


def test_a_model_whose_tokenizer_does_not_load_is_one_line(tmp_path, tiny_model):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").write_text("{}")
    line, _ = user_error(serve(model))
    assert line == f"hpcrl: the tokenizer in {model} does not load (KeyError: 'added_tokens')"
