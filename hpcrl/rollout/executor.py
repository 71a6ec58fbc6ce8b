"""Asynchronous rollout with a staleness bound that holds for every group, and a bound on rejections.

Episodes (one prompt's group) run concurrently, up to ``max_concurrent`` at once. An episode may start
only while it can be trained on within ``max_staleness`` weight versions of the one it starts under:
with a batch of ``batch_size`` groups per train step, at most ``(version + max_staleness + 1) *
batch_size`` groups may have been accepted or be in flight. ``max_staleness=0`` is synchronous
rollout: the next batch starts only after the weights it will be trained against are on the servers.

Batches are taken in START order, never in completion order: a batch is the oldest ``batch_size``
groups that were started and not rejected, and it waits until all of them have finished. That is what
makes the bound hold for every group, whatever order episodes finish in. A group started under version
``v`` had at most ``(v + max_staleness + 1) * batch_size - 1`` groups before it that could be accepted
(those accepted then, and those in flight), so it lands in batch ``v + max_staleness + 1`` at the latest,
which trains weights of version ``v + max_staleness``; and its first token was sampled with weights of
version ``v`` or newer. Taken in completion order, a slow group could be overtaken by faster ones started
after it and pushed to a later batch, past the bound. Waiting for it costs time when completion lengths
vary a lot; dropping it instead would waste its work and bias training against long completions.

The capacity is recomputed whenever an episode completes or the version changes, not once per round.
Groups that are rejected free their capacity, so the executor starts replacements. The causes: the
``reject`` policy's (a failed reward under ``reward.on_error=drop``, all-equal rewards under DAPO) and
episode errors ``classify`` names (a prompt too long for the context, requests that failed through the
client's retries or that a server kept aborting with no new token). ``max_rejected_in_a_row`` rejections
with no accepted group between fail the run with the counts by cause and what to change; a batch for which
more groups were rejected than accepted logs a warning saying the same.

For checkpoints, the executor knows which rows it drew whose groups no batch has taken yet (in flight, or
accepted and waiting): ``unbatched_rows``, in start order. A resumed run draws them again, and ``restore``
puts the counts where the checkpointed run left them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

Episode = Callable[[Any], Awaitable[Any]]

# why a group is not trained on, with what to change; the keys are the causes ``reject`` and ``classify`` return
CAUSES = {
    "reward_error": (
        "reward errors",
        "the reward function raised or timed out under reward.on_error=drop: fix it, or set reward.on_error=zero",
    ),
    "equal_rewards": (
        "all-equal rewards",
        "every sample of the group got the same reward and algorithm.drop_equal_reward_groups drops such groups: "
        "the task is too hard or too easy for the model, or set algorithm.drop_equal_reward_groups=false",
    ),
    "too_long": (
        "too long",
        "the prompt plus rollout.max_new_tokens exceeds the model's context: lower rollout.max_new_tokens or "
        "shorten the prompts",
    ),
    "failed": (
        "failed",
        "episodes failed through the inference client's retries, or a server answered a sample aborted with no new "
        "token rollout.max_empty_aborts times in a row: see the servers' logs (logs/server-N.log)",
    ),
}


class RolloutStalled(RuntimeError):
    """Too many groups in a row were rejected: the rollout would never fill a batch."""


@dataclass
class _Slot:
    """A started group: in flight until ``done``; accepted then (rejected ones leave the queue)."""

    row: Any
    group: Any = None
    done: bool = False


class RolloutExecutor:
    def __init__(
        self,
        episode: Episode,
        rows: Iterator[Any],  # endless: the controller cycles through its data
        batch_size: int,
        max_concurrent: int,
        max_staleness: int,
        reject: Callable[[Any], tuple[str, str] | None] = lambda _: None,  # (cause, what happened), or None: keep it
        classify: Callable[[BaseException], str | None] = lambda _: None,  # cause of an episode error, or None
        max_rejected_in_a_row: int = 0,  # 0: 4 batches' worth
    ):
        self.episode, self.rows, self.reject, self.classify = episode, rows, reject, classify
        # an error classify names drops only its group; any other fails the run at once
        self.max_rejected_in_a_row = max_rejected_in_a_row or 4 * batch_size
        self.batch_size, self.max_concurrent, self.max_staleness = batch_size, max_concurrent, max_staleness
        self.version = 0  # weight version the servers hold
        self.accepted_total = 0  # groups accepted since the start (including those already trained on)
        self.rejected: Counter[str] = Counter()  # groups rejected since the start, by cause
        self.in_a_row: Counter[str] = Counter()  # rejected since the last accepted group, by cause
        self.since_batch: Counter[str] = Counter()  # finished since the last batch was taken: "accepted" and causes
        self.last_error: dict[str, str] = {}  # cause -> the last error of that cause
        self.queue: deque[_Slot] = deque()  # started groups no batch has taken, in start order
        self.running: dict[asyncio.Task, _Slot] = {}
        self._wake_pump = asyncio.Event()  # an episode ended or the version changed
        self._wake_batch = asyncio.Event()  # an episode ended (or failed)
        self._pump_task: asyncio.Task | None = None
        self._error: BaseException | None = None

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def capacity(self) -> int:
        by_staleness = (self.version + self.max_staleness + 1) * self.batch_size
        return min(self.max_concurrent - len(self.running), by_staleness - self.accepted_total - len(self.running))

    def start(self) -> None:
        self._pump_task = asyncio.create_task(self._pump(), name="rollout-pump")

    def set_version(self, version: int) -> None:
        """The servers hold ``version``: the groups it lets start are started now (they run at the caller's next
        await), not at the pump's next turn."""
        self.version = version
        self._start_what_fits()

    def restore(self, version: int, batches_trained: int, rejected: dict[str, int]) -> None:
        """Go on from a checkpoint (before ``start``): the servers hold ``version``, ``batches_trained`` batches were
        trained on. Groups accepted but not trained on then are not here: their rows are drawn again."""
        self.version = version
        self.accepted_total = batches_trained * self.batch_size
        self.rejected = Counter(rejected)

    def unbatched_rows(self) -> list[Any]:
        """Rows drawn whose groups are in no batch yet (accepted and waiting, or in flight), in start order."""
        return [slot.row for slot in self.queue]

    def _batch_ready(self) -> bool:
        return len(self.queue) >= self.batch_size and all(self.queue[i].done for i in range(self.batch_size))

    async def next_batch(self) -> list[Any]:
        """The ``batch_size`` oldest-started groups that are not rejected, once every one of them has finished."""
        while not self._batch_ready():
            if self._error is not None:
                raise self._error
            self._wake_batch.clear()
            await self._wake_batch.wait()
        batch = [self.queue.popleft().group for _ in range(self.batch_size)]
        self._warn_if_mostly_rejected()
        return batch

    async def close(self) -> None:
        tasks = [t for t in (self._pump_task, *self.running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self) -> None:
        while self._error is None:
            self._start_what_fits()
            self._wake_pump.clear()
            await self._wake_pump.wait()

    def _start_what_fits(self) -> None:
        """Start as many groups as the concurrency and staleness bounds allow."""
        if self._error is not None or self._pump_task is None:  # failed, or not started yet
            return
        try:
            for _ in range(max(0, self.capacity())):
                slot = _Slot(next(self.rows))
                task = asyncio.create_task(self.episode(slot.row))
                self.running[task] = slot
                self.queue.append(slot)
                task.add_done_callback(self._done)
        except Exception as e:  # e.g. the rows ran out: next_batch must not wait forever
            self._error = e
            self._wake_batch.set()

    def _done(self, task: asyncio.Task) -> None:
        slot = self.running.pop(task, None)
        if task.cancelled() or slot is None:
            return
        cause = None
        try:
            group = task.result()
            if rejected := self.reject(group):
                cause, self.last_error[rejected[0]] = rejected
        except Exception as e:  # the episode, or the reject policy (e.g. reward.on_error=fail), failed
            cause = self.classify(e)
            if cause is None:
                self._error = self._error or e  # the first failure is the one to report
            else:
                self.last_error[cause] = f"{type(e).__name__}: {e}"
                log.warning("an episode failed (%s) and its group is dropped: %s", CAUSES[cause][0], e)
        if cause is None and self._error is None:
            slot.group, slot.done = group, True
            self.accepted_total += 1
            self.in_a_row.clear()
            self.since_batch["accepted"] += 1
        else:
            self.queue.remove(slot)
            if cause is not None:
                self._rejected(cause)
        self._wake_pump.set()
        self._wake_batch.set()

    def _rejected(self, cause: str) -> None:
        self.rejected[cause] += 1
        self.in_a_row[cause] += 1
        self.since_batch[cause] += 1
        if sum(self.in_a_row.values()) >= self.max_rejected_in_a_row and self._error is None:
            self._error = RolloutStalled(self.stall_message())

    def stall_message(self) -> str:
        n = sum(self.in_a_row.values())
        return (
            f"the rollout is stuck: {n} groups in a row were rejected and none accepted "
            f"(rollout.max_rejected_in_a_row={self.max_rejected_in_a_row}): {self._by_cause(self.in_a_row)}; "
            "or raise rollout.max_rejected_in_a_row"
        )

    def _by_cause(self, counts: Counter[str]) -> str:
        """``3 reward errors, 0 all-equal rewards, ...; why and what to change`` for the causes counted."""
        tally = ", ".join(f"{counts[c]} {name}" for c, (name, _) in CAUSES.items())
        advice = [
            f"{name}: {what}" + (f" (last: {self.last_error[c]})" if c in self.last_error else "")
            for c, (name, what) in CAUSES.items()
            if counts[c]
        ]
        return f"{tally}. " + "; ".join(advice)

    def _warn_if_mostly_rejected(self) -> None:
        accepted = self.since_batch.pop("accepted", 0)
        rejected = sum(self.since_batch.values())
        if rejected > accepted:
            log.warning(
                "%d of the %d groups finished for this batch were rejected: %s",
                rejected,
                rejected + accepted,
                self._by_cause(self.since_batch),
            )
        self.since_batch.clear()
