"""The run's start-up, phase by phase: from the command's start (the controller process's creation, so Python's own
start and the imports count) to the first step, each phase's seconds in one log line and the total in the summary
(``startup_s``).

    python, imports, config   until the job begins (``run_job``)
    data and model            the rows loaded, the tiny model made or the model path resolved
    workers                   every role's workers started and registered (servers loaded and healthy, ranks up)
    weight sync setup         the clients opened, the weight group set up (distributed sync), a LoRA adapter's first
                              push
    first evaluation          the held-out accuracy before step 1 (a resume's phase: checkpoint loaded, the newest
                              checkpoint loaded and pushed to the servers)
"""

from __future__ import annotations

import logging
import time

import psutil

log = logging.getLogger(__name__)


class Startup:
    """Marks the end of each phase (``mark``); ``line`` says what each took."""

    def __init__(self, began: float | None = None):
        self.began = psutil.Process().create_time() if began is None else began  # epoch seconds
        self.marks: list[tuple[str, float]] = []  # (phase, epoch seconds at its end), in order

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.time()))

    def seconds(self) -> float:
        """From the command's start to the last mark."""
        return (self.marks[-1][1] if self.marks else time.time()) - self.began

    def line(self) -> str:
        parts, since = [], self.began
        for phase, at in self.marks:
            parts.append(f"{phase} {at - since:.1f} s")
            since = at
        return f"start-up took {self.seconds():.1f} s to the first step: " + ", ".join(parts)
