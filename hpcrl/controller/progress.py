"""A progress bar on stderr: step, mean reward and the latest held-out accuracy.

While it shows, log lines to the terminal are written above it (``tqdm``'s logging redirect), so the controller's
line per step (``metrics.step_line``) and the bar do not garble each other; the log file gets every line as is.
"""

from __future__ import annotations

from typing import Any


class Progress:
    def __init__(self, total: int):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=total, desc="steps", unit="step", dynamic_ncols=True, leave=True)
        self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
        self._accuracy: float | None = None

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        self._accuracy = metrics.get("eval_accuracy", self._accuracy)
        postfix = {"reward": f"{metrics.get('reward_mean', 0.0):.3f}"}
        if self._accuracy is not None:
            postfix["acc"] = f"{self._accuracy:.2f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def __enter__(self) -> Progress:
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.close()
        self._redirect.__exit__(*exc)
