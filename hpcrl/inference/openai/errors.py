"""The error of a request the OpenAI routes cannot serve as given."""

from __future__ import annotations


class OpenAIError(ValueError):
    """A request that cannot be served as given: answered with ``status`` and this message (``param``: the field)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param
