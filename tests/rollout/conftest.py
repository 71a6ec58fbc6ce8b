"""The real CPU server fixtures of tests/inference, for the episode and workflow tests here."""

from tests.inference.conftest import long_server, server, tiny_model_b  # noqa: F401  (pytest fixtures)
