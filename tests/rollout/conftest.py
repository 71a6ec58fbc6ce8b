"""The real CPU server fixtures of tests/inference, for the episode and workflow tests here; and one server of the
agent task's model for the agent tests (proxy, plug-in workflow, standalone evaluation), started once a session."""

import pytest
from safetensors.torch import load_file, save_file

from hpcrl.models.tiny import make_tiny_model
from tests.inference.conftest import ServerProc, long_server, server, tiny_model_b  # noqa: F401  (pytest fixtures)

AGENT_ALPHABET = "0123456789+=?"  # the agent task's characters: digits, "+", the tool result's "=", the call "?"
WEIGHT_SCALE = 10.0  # a fresh tiny model answers every prompt alike; scaled up, its greedy answers differ by prompt


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory):
    """A tiny model of the agent alphabet whose greedy answers depend on the prompt; some are the call ``?``."""
    path = make_tiny_model(tmp_path_factory.mktemp("agent-model"), characters=AGENT_ALPHABET, seed=4)
    weights = path / "model.safetensors"
    tensors = {k: v if "norm" in k else v * WEIGHT_SCALE for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def agent_server(agent_model, tmp_path_factory):
    """``experiment=mod10_agent``'s serving: the tiny_tools chat template and the tiny tool-call parser."""
    log = tmp_path_factory.mktemp("agent-server") / "server.log"
    proc = ServerProc(agent_model, log, "127.0.0.1", "--chat-template", "tiny_tools", "--tool-call-parser", "tiny")
    yield proc
    proc.stop()
