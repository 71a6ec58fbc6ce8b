"""The one error a bad config raises: it names the field, the bad value and the expected form."""

from __future__ import annotations

from typing import Any

from hpcrl.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value is wrong; raised before anything is started or submitted."""

    label = "config error"

    def __init__(self, path: str, value: Any, expected: str):
        self.path, self.value, self.expected = path, value, expected
        super().__init__(f"{path}={value!r} is invalid: expected {expected}")


def require(ok: bool, path: str, value: Any, expected: str) -> None:
    """Raise ConfigError(path, value, expected) unless ok."""
    if not ok:
        raise ConfigError(path, value, expected)


def one_of(path: str, value: Any, allowed: tuple[str, ...]) -> None:
    require(value in allowed, path, value, f"one of {', '.join(allowed)}")
