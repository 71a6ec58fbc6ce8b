"""The result of one reward call, and the error a failed reward raises under ``reward.on_error=fail``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RewardOutcome:
    """One reward call: ``value`` when it succeeded, else ``error`` saying what went wrong."""

    value: float | None = None  # the reward; None when the call failed
    error: str | None = None  # e.g. "raised ValueError: bad answer" or "timed out after 2 s"; None on success
    timed_out: bool = False  # the call ran past reward.timeout_s (its worker was killed)
    parts: dict[str, float] | None = None  # reward.fn as a list: each function's own value by name; None otherwise

    @property
    def ok(self) -> bool:
        return self.error is None


class RewardError(RuntimeError):
    """Rewards failed and ``reward.on_error=fail`` says that ends the run."""
