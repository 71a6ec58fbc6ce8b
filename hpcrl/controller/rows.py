"""The training rows in the order a run draws them, from a position a checkpoint saves and restores.

The order: epoch ``e`` is every row once, shuffled by ``random.Random(f"{seed}/{e}")``, so draw ``n`` (epoch
``n // len(rows)``, place ``n % len(rows)``) is found without replaying the epochs before it. The position is the
number of rows drawn from that order.

The rollout draws ahead of training: at a checkpoint, some drawn rows are still in flight, or their groups wait,
accepted, for a later batch (the executor's ``unbatched_rows``). The saved state keeps them as ``replay``: a resumed
run draws them first, then goes on from the position, so it trains on the rows an uninterrupted run would have
trained on, none skipped and none twice.

Each row drawn is a copy with its draw number added (``"draw"``), which a replayed row keeps: the rollout derives
the episode's sampling seed from it (``run.seed``, the draw), so a resumed run samples a row as it was sampled
before, and two epochs sample the same row differently.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

Row = dict[str, Any]


class TrainingRows:
    """An endless iterator over the training rows (the rollout executor's ``rows``)."""

    def __init__(self, rows: list[Row], seed: int):
        if not rows:
            raise ValueError("the training split has no rows: check dataset.* (train_size, train_files)")
        self.rows, self.seed = rows, seed
        self.drawn = 0  # rows drawn from the shuffled order (rows replayed from a checkpoint not counted)
        self.replay: deque[Row] = deque()
        self._epoch = -1  # the epoch whose order is cached
        self._order: list[int] = []

    def __iter__(self) -> TrainingRows:
        return self

    def __next__(self) -> Row:
        if self.replay:
            return self.replay.popleft()
        row = {**self.row_at(self.drawn), "draw": self.drawn}
        self.drawn += 1
        return row

    def row_at(self, n: int) -> Row:
        """The row of draw ``n`` (0-based) in the shuffled order."""
        epoch, place = divmod(n, len(self.rows))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.epoch_order(epoch)
        return self.rows[self._order[place]]

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def state(self, unbatched: list[Row]) -> dict[str, Any]:
        """The position, with ``unbatched`` (drawn, not trained on yet) and rows not yet replayed to draw again."""
        return {"size": len(self.rows), "seed": self.seed, "drawn": self.drawn, "replay": [*unbatched, *self.replay]}

    def restore(self, state: dict[str, Any]) -> None:
        saved = (state["size"], state["seed"])
        if saved != (len(self.rows), self.seed):
            raise ValueError(
                f"the checkpoint's data position is for {saved[0]} training rows shuffled with run.seed={saved[1]}, "
                f"this run has {len(self.rows)} rows and run.seed={self.seed}: resume with the dataset and seed "
                "the run was started with, or start a new run.trial"
            )
        self.drawn = int(state["drawn"])
        self.replay = deque(state["replay"])
