"""A progress bar on stderr: step, mean reward and the latest held-out accuracy."""

from __future__ import annotations

from typing import Any


class Progress:
    def __init__(self, total: int):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="steps", unit="step", dynamic_ncols=True, leave=True)
        self._accuracy: float | None = None

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        self._accuracy = metrics.get("eval_accuracy", self._accuracy)
        postfix = {"reward": f"{metrics.get('reward_mean', 0.0):.3f}"}
        if self._accuracy is not None:
            postfix["acc"] = f"{self._accuracy:.2f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.close()
