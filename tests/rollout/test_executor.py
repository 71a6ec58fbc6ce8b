"""The staleness-bounded rollout executor's scheduling logic, with fake episodes."""

import asyncio
import itertools
import logging

import pytest

from hpcrl.rollout.executor import RolloutExecutor, RolloutStalled


class Episodes:
    """Episodes that finish when the test releases them; records when each started, and under which version."""

    def __init__(self):
        self.started: list[int] = []
        self.release: dict[int, asyncio.Event] = {}
        self.executor: RolloutExecutor | None = None
        self.version: dict[int, int] = {}  # row -> the weight version the servers held when it started

    async def __call__(self, row: int) -> int:
        self.started.append(row)
        if self.executor is not None:
            self.version[row] = self.executor.version
        self.release[row] = asyncio.Event()
        await self.release[row].wait()
        return row

    def finish(self, *rows: int) -> None:
        for row in rows:
            self.release[row].set()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize(("staleness", "expected"), [(0, 4), (1, 8), (2, 12)])
def test_episodes_started_are_bounded_by_staleness(staleness, expected):
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(eps, itertools.count(), batch_size=4, max_concurrent=100, max_staleness=staleness)
        ex.start()
        await settle()
        assert len(eps.started) == expected
        eps.finish(*range(expected))
        await settle()
        assert len(eps.started) == expected, "nothing more may start before the version moves"
        assert await ex.next_batch() == [0, 1, 2, 3]
        ex.set_version(1)
        await settle()
        assert len(eps.started) == expected + 4
        await ex.close()

    run(scenario())


def test_a_new_version_starts_its_groups_before_the_callers_next_await_returns():
    # the loop yields once after set_version and then logs the step: the next batch's episodes must have run to
    # their first wait by then (their requests sent), not only be due at the pump's next turn
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(eps, itertools.count(), batch_size=2, max_concurrent=100, max_staleness=0)
        ex.start()
        await settle()
        eps.finish(0, 1)
        assert await ex.next_batch() == [0, 1]
        ex.set_version(1)
        await asyncio.sleep(0)
        assert eps.started == [0, 1, 2, 3]
        await ex.close()

    run(scenario())


def test_synchronous_batches_train_on_their_own_version():
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(eps, itertools.count(), batch_size=2, max_concurrent=100, max_staleness=0)
        ex.start()
        for version in range(3):
            await settle()
            assert eps.started == list(range(2 * version + 2))
            eps.finish(2 * version, 2 * version + 1)
            assert await ex.next_batch() == [2 * version, 2 * version + 1]
            ex.set_version(version + 1)
        await ex.close()

    run(scenario())


def test_capacity_is_recomputed_whenever_an_episode_completes():
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(eps, itertools.count(), batch_size=8, max_concurrent=2, max_staleness=0)
        ex.start()
        await settle()
        assert eps.started == [0, 1]
        eps.finish(0)
        await settle()
        assert eps.started == [0, 1, 2], "a slot freed by one episode is refilled at once"
        eps.finish(2)
        await settle()
        assert eps.started == [0, 1, 2, 3]
        await ex.close()

    run(scenario())


def test_rejected_groups_free_their_capacity():
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(
            eps,
            itertools.count(),
            batch_size=2,
            max_concurrent=10,
            max_staleness=0,
            reject=lambda r: None if r % 2 == 0 else ("equal_rewards", "every reward 0.0"),
        )
        ex.start()
        await settle()
        eps.finish(0, 1)
        await settle()
        assert eps.started == [0, 1, 2], "the rejected group 1 is replaced"
        eps.finish(2)
        assert await ex.next_batch() == [0, 2]
        assert ex.rejected_total == 1 and ex.rejected == {"equal_rewards": 1}
        await ex.close()

    run(scenario())


def test_a_failed_episode_reaches_next_batch():
    async def scenario():
        async def boom(row):
            raise RuntimeError(f"episode {row} failed")

        ex = RolloutExecutor(boom, itertools.count(), batch_size=2, max_concurrent=2, max_staleness=0)
        ex.start()
        with pytest.raises(RuntimeError, match="episode 0 failed"):
            await ex.next_batch()
        await ex.close()

    run(scenario())


def test_unbatched_rows_are_those_waiting_or_in_flight():
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(eps, itertools.count(), batch_size=2, max_concurrent=100, max_staleness=1)
        ex.start()
        await settle()
        assert eps.started == [0, 1, 2, 3]
        eps.finish(0, 1, 3)
        assert await ex.next_batch() == [0, 1]
        assert ex.unbatched_rows() == [2, 3], "3 waits accepted, 2 is in flight; in start order"
        await ex.close()

    run(scenario())


def test_a_restored_executor_goes_on_with_the_checkpoints_version_and_counts():
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(eps, itertools.count(10), batch_size=2, max_concurrent=100, max_staleness=1)
        ex.restore(version=3, batches_trained=3, rejected={"reward_error": 2, "failed": 3})
        ex.start()
        await settle()
        assert eps.started == [10, 11, 12, 13], "capacity as after 3 batches: this batch and the next"
        assert ex.rejected_total == 5 and ex.rejected["failed"] == 3
        await ex.close()

    run(scenario())


class Flaky(Exception):
    """Stands for an inference error after the client's retries."""


def flaky_fails_its_group(error: BaseException) -> str | None:
    return "failed" if isinstance(error, Flaky) else None


def test_a_classified_episode_error_drops_its_group_and_the_rollout_goes_on():
    async def scenario():
        async def episode(row: int) -> int:
            if row in (1, 2):
                raise Flaky(f"row {row}")
            return row

        ex = RolloutExecutor(
            episode, itertools.count(), batch_size=2, max_concurrent=2, max_staleness=0, classify=flaky_fails_its_group
        )
        ex.start()
        assert await ex.next_batch() == [0, 3], "the failed rows' groups are dropped, replacements start"
        assert ex.rejected == {"failed": 2}
        await ex.close()

    run(scenario())


def test_an_error_that_is_not_classified_fails_the_run_at_once():
    async def scenario():
        async def episode(row: int) -> int:
            raise KeyError("a bug")

        ex = RolloutExecutor(
            episode, itertools.count(), batch_size=2, max_concurrent=2, max_staleness=0, classify=flaky_fails_its_group
        )
        ex.start()
        with pytest.raises(KeyError):
            await ex.next_batch()
        assert ex.rejected_total == 0
        await ex.close()

    run(scenario())


# ---------------------------------------------------------------- the staleness bound, per group


async def drive_adversarially(ex: RolloutExecutor, eps: Episodes, steps: int, hold: int) -> list[list[int]]:
    """The training loop against an adversarial finishing order: every episode finishes at once except the
    oldest one in flight, which is held back for ``hold`` steps, or until the rollout cannot make a batch
    without it. Returns the batches, step by step."""
    batches, held_since = [], {}
    for step in range(1, steps + 1):
        while True:
            await settle()
            running = [r for r in eps.started if not eps.release[r].is_set()]
            if running:
                oldest = running[0]
                held_since.setdefault(oldest, step)
                eps.finish(*running[1:])
                if step - held_since[oldest] >= hold:
                    eps.finish(oldest)
            await settle()
            try:
                batches.append(await asyncio.wait_for(ex.next_batch(), 0.05))
                break
            except TimeoutError:  # it cannot go on without the oldest: let it finish
                eps.finish(*[r for r in eps.started if not eps.release[r].is_set()][:1])
        ex.set_version(step)
    return batches


@pytest.mark.parametrize(("staleness", "batch_size"), [(0, 2), (1, 2), (2, 3), (1, 1)])
def test_no_group_is_trained_past_the_staleness_bound_whatever_order_episodes_finish_in(staleness, batch_size):
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(eps, itertools.count(), batch_size=batch_size, max_concurrent=100, max_staleness=staleness)
        eps.executor = ex
        ex.start()
        batches = await drive_adversarially(ex, eps, steps=8, hold=3)
        for step, batch in enumerate(batches, start=1):
            trained_with = step - 1  # the weights step s trains are version s - 1
            lag = {row: trained_with - eps.version[row] for row in batch}
            late = {row: versions for row, versions in lag.items() if versions > staleness}
            assert not late, f"step {step} trains groups {late} versions behind (max_staleness={staleness})"
        trained = [row for batch in batches for row in batch]
        assert trained == sorted(trained) == list(range(len(trained))), "batches are taken in start order"
        await ex.close()

    run(scenario())


# ---------------------------------------------------------------- rejections


def test_rejections_in_a_row_fail_the_run_with_counts_by_cause_and_what_to_change():
    async def scenario():
        async def episode(row: int) -> int:
            if row % 4 == 3:
                raise Flaky(f"server said 503 for row {row}")
            return row

        causes = {0: "reward_error", 1: "equal_rewards", 2: "equal_rewards"}
        ex = RolloutExecutor(
            episode,
            itertools.count(),
            batch_size=2,
            max_concurrent=2,
            max_staleness=0,
            reject=lambda row: (causes[row % 4], f"row {row}"),
            classify=flaky_fails_its_group,
        )
        ex.start()
        with pytest.raises(RolloutStalled) as stalled:
            await ex.next_batch()
        message = str(stalled.value)
        assert "\n" not in message
        assert message.startswith("the rollout is stuck: 8 groups in a row were rejected and none accepted ")
        counts = "2 reward errors, 4 all-equal rewards, 0 too long, 2 failed"
        assert f"(rollout.max_rejected_in_a_row=8): {counts}" in message
        assert "reward.on_error=zero" in message and "algorithm.drop_equal_reward_groups=false" in message
        assert "last: Flaky: server said 503 for row 7" in message and "(last: row 6)" in message
        assert "rollout.max_new_tokens" not in message, "advice only for the causes that occurred"
        assert message.endswith("or raise rollout.max_rejected_in_a_row")
        await ex.close()

    run(scenario())


def test_an_accepted_group_resets_the_count_in_a_row():
    async def scenario():
        async def episode(row: int) -> int:
            return row

        # two rejected, one accepted, over and over: never 3 in a row
        ex = RolloutExecutor(
            episode,
            itertools.count(),
            batch_size=2,
            max_concurrent=1,
            max_staleness=0,
            reject=lambda row: None if row % 3 == 2 else ("equal_rewards", "every reward 0.0"),
            max_rejected_in_a_row=3,
        )
        ex.start()
        for version in range(1, 4):
            assert await ex.next_batch() == [6 * version - 4, 6 * version - 1]
            ex.set_version(version)
        assert ex.rejected == {"equal_rewards": 12}
        await ex.close()

    run(scenario())


def test_a_batch_with_more_rejected_groups_than_accepted_logs_a_warning(caplog):
    async def scenario():
        async def episode(row: int) -> int:
            return row

        ex = RolloutExecutor(
            episode,
            itertools.count(),
            batch_size=2,
            max_concurrent=1,
            max_staleness=0,
            reject=lambda row: ("equal_rewards", "every reward 0.0") if row in (0, 1, 2) else None,
        )
        ex.start()
        with caplog.at_level(logging.WARNING, logger="hpcrl.rollout.executor"):
            assert await ex.next_batch() == [3, 4]
            ex.set_version(1)
            assert await ex.next_batch() == [5, 6]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith("3 of the 5 groups finished for this batch were rejected: 0 reward errors, 3 all")
        await ex.close()

    run(scenario())
