"""One line per check: ``<status>  <check>: <what was found>; <what to do>``.

    ok    the check passed
    warn  it passed with a caveat, or could not be made (a probe job that never left the queue)
    fail  a run with this config and cluster would fail here; the advice says what to change
    skip  the check does not apply (a CPU cluster has no GPUs to check); the line says why

The doctor exits non-zero when any line is ``fail``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

STATUSES = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True)
class Result:
    status: str  # ok | warn | fail | skip
    check: str  # what was checked, e.g. "ports" or "sbatch server"
    found: str  # what the check found
    advice: str = ""  # what to do about it; "" when there is nothing to do

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"a check's status is one of {', '.join(STATUSES)}, got {self.status!r}")

    def line(self) -> str:
        """The result on one line: what sbatch or a probe printed on several is joined."""
        advice = f"; {_one_line(self.advice)}" if self.advice else ""
        return f"{self.status:<4}  {self.check}: {_one_line(self.found)}{advice}"


def ok(check: str, found: str) -> Result:
    return Result("ok", check, found)


def warn(check: str, found: str, advice: str) -> Result:
    return Result("warn", check, found, advice)


def fail(check: str, found: str, advice: str) -> Result:
    return Result("fail", check, found, advice)


def skip(check: str, why: str) -> Result:
    return Result("skip", check, why)


def _one_line(text: str) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def exit_code(results: Iterable[Result]) -> int:
    """1 when any check failed, else 0."""
    return int(any(r.status == "fail" for r in results))
