"""Asynchronous rollout with a staleness bound.

Episodes (one prompt's group) run concurrently, up to ``max_concurrent`` at once. An episode may start
only while it can be trained on within ``max_staleness`` weight versions of the one it starts under:
with a batch of ``batch_size`` groups per train step, at most ``(version + max_staleness + 1) *
batch_size`` groups may have been accepted or be in flight. ``max_staleness=0`` is synchronous
rollout: the next batch starts only after the weights it will be trained against are on the servers.

The capacity is recomputed whenever an episode completes or the version changes, not once per round.
Groups the filter rejects (all-equal rewards under DAPO, failed rewards under ``drop``) free their
capacity, so the executor starts replacements.

For checkpoints, the executor knows which rows it drew whose groups no batch has taken yet (in flight, or
accepted and waiting): ``unbatched_rows``. A resumed run draws them again, and ``restore`` puts the counts
where the checkpointed run left them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

Episode = Callable[[Any], Awaitable[Any]]


class RolloutExecutor:
    def __init__(
        self,
        episode: Episode,
        rows: Iterator[Any],  # endless: the controller cycles through its data
        batch_size: int,
        max_concurrent: int,
        max_staleness: int,
        accept: Callable[[Any], bool] = lambda _: True,
        tolerated: tuple[type[BaseException], ...] = (),
        max_failures_in_a_row: int = 0,
    ):
        self.episode, self.rows, self.accept = episode, rows, accept
        # episode errors that drop only their group (inference errors after the client's retries); more than
        # max_failures_in_a_row of them with no success between (0: 2 batches' worth) fail the run
        self.tolerated = tolerated
        self.max_failures_in_a_row = max_failures_in_a_row or 2 * batch_size
        self.failed_total = self.failures_in_a_row = 0
        self.batch_size, self.max_concurrent, self.max_staleness = batch_size, max_concurrent, max_staleness
        self.version = 0  # weight version the servers hold
        self.accepted_total = 0  # groups accepted since the start (including those already trained on)
        self.rejected_total = 0
        self.ready: list[tuple[Any, Any]] = []  # (row, group) of accepted groups, oldest first
        self.running: dict[asyncio.Task, Any] = {}  # episode task -> its row
        self._wake_pump = asyncio.Event()  # an episode ended or the version changed
        self._wake_batch = asyncio.Event()  # an episode ended (or failed)
        self._pump_task: asyncio.Task | None = None
        self._error: BaseException | None = None

    def capacity(self) -> int:
        by_staleness = (self.version + self.max_staleness + 1) * self.batch_size
        return min(self.max_concurrent - len(self.running), by_staleness - self.accepted_total - len(self.running))

    def start(self) -> None:
        self._pump_task = asyncio.create_task(self._pump(), name="rollout-pump")

    def set_version(self, version: int) -> None:
        self.version = version
        self._wake_pump.set()

    def restore(self, version: int, batches_trained: int, rejected_total: int) -> None:
        """Go on from a checkpoint (before ``start``): the servers hold ``version``, ``batches_trained`` batches were
        trained on. Groups accepted but not trained on then are not here: their rows are drawn again."""
        self.version = version
        self.accepted_total = batches_trained * self.batch_size
        self.rejected_total = rejected_total

    def unbatched_rows(self) -> list[Any]:
        """Rows drawn whose groups are in no batch yet: accepted and waiting, then in flight."""
        return [row for row, _ in self.ready] + list(self.running.values())

    async def next_batch(self) -> list[Any]:
        """The oldest ``batch_size`` accepted groups, once there are that many."""
        while len(self.ready) < self.batch_size:
            if self._error is not None:
                raise self._error
            self._wake_batch.clear()
            await self._wake_batch.wait()
        batch, self.ready = self.ready[: self.batch_size], self.ready[self.batch_size :]
        return [group for _, group in batch]

    async def close(self) -> None:
        tasks = [t for t in (self._pump_task, *self.running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self) -> None:
        try:
            while True:
                for _ in range(max(0, self.capacity())):
                    row = next(self.rows)
                    task = asyncio.create_task(self.episode(row))
                    self.running[task] = row
                    task.add_done_callback(self._done)
                self._wake_pump.clear()
                await self._wake_pump.wait()
        except Exception as e:  # e.g. the rows ran out: next_batch must not wait forever
            self._error = e
            self._wake_batch.set()

    def _episode_failed(self, row: Any, error: BaseException) -> None:
        self.failed_total += 1
        self.failures_in_a_row += 1
        log.warning("an episode failed and its group is dropped (%d in a row): %s", self.failures_in_a_row, error)
        if self.failures_in_a_row >= self.max_failures_in_a_row:
            message = f"{self.failures_in_a_row} episodes in a row failed; the last: {error}"
            self._error = self._error or RuntimeError(message)

    def _done(self, task: asyncio.Task) -> None:
        row = self.running.pop(task, None)
        if task.cancelled():
            return
        try:
            group = task.result()
            accepted = self.accept(group)
        except self.tolerated as e:  # the group fails (the client's retries are spent), is counted, and the run goes on
            self._episode_failed(row, e)
        except Exception as e:  # the episode, or the accept policy (e.g. reward.on_error=fail), failed
            self._error = self._error or e  # the first failure is the one to report
        else:
            self.failures_in_a_row = 0
            if accepted:
                self.ready.append((row, group))
                self.accepted_total += 1
            else:
                self.rejected_total += 1
        self._wake_pump.set()
        self._wake_batch.set()
