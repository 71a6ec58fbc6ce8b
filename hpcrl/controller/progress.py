"""The run's progress: a bar on a terminal, a log line every tenth of the run anywhere else.

    with Progress(total) as progress:        # stderr a terminal: a tqdm bar (step, mean reward, latest accuracy)
        progress.update(step, metrics)       # otherwise (a pipe, a file, a Slurm job's output): every
                                             # ``every`` steps and at the last, "progress: step 40 of 200 (20%),
                                             # 2.41 s a step, about 6.4 min to go"

A bar drawn into a file is a line of carriage-return frames that grows with every step, so away from a terminal
the controller's own line per step (``metrics.step_line``) says what the bar would, and these lines add how far
the run is. While the bar shows, log lines to the terminal are written above it (``tqdm``'s logging redirect), so
the two do not garble each other; the log file gets every line as is.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

log = logging.getLogger(__name__)
LINES = 10  # progress lines over a whole run away from a terminal (and one at its last step)


class Progress:
    """The bar (``Bar``) when ``stream`` (stderr by default) is a terminal, else the lines (``Lines``)."""

    def __init__(self, total: int, stream: TextIO | None = None):
        stream = sys.stderr if stream is None else stream
        self._view: Bar | Lines = Bar(total, stream) if _is_terminal(stream) else Lines(total)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        self._view.update(step, metrics)

    def __enter__(self) -> Progress:
        self._view.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._view.__exit__(*exc)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Bar:
    """A tqdm bar on ``stream``: step, mean reward and the latest held-out accuracy."""

    def __init__(self, total: int, stream: TextIO):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=total, desc="steps", unit="step", dynamic_ncols=True, leave=True, file=stream)
        self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
        self._accuracy: float | None = None

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        self._accuracy = metrics.get("eval_accuracy", self._accuracy)
        postfix = {"reward": f"{metrics.get('reward_mean', 0.0):.3f}"}
        if self._accuracy is not None:
            postfix["acc"] = f"{self._accuracy:.2f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def __enter__(self) -> Bar:
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.close()
        self._redirect.__exit__(*exc)


class Lines:
    """A log line every ``every`` steps (a tenth of ``total``, at least 1) and at step ``total``: the step, the
    share done, the time a step took on average since the first step seen here, and the time to go at that pace."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic):
        self.total = total
        self.every = max(1, math.ceil(total / LINES))
        self._clock = clock
        self._start: tuple[int, float] | None = None  # (the step before the first one seen, when that one ended)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        now = self._clock()
        if self._start is None:  # the pace counts from the end of the first step seen (a resumed run's is past 1)
            self._start = (step, now)
        if self._due(step):
            first, then = self._start
            self._line(step, (now - then) / (step - first) if step > first else None)

    def _due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total

    def _line(self, step: int, step_s: float | None) -> None:
        share = f"step {step} of {self.total} ({100 * step // max(1, self.total)}%)"
        if step_s is None:
            log.info("progress: %s", share)
            return
        to_go = max(0, self.total - step) * step_s
        log.info("progress: %s, %.2f s a step, about %s to go", share, step_s, _duration(to_go))

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
