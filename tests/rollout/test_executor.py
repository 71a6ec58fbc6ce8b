"""The staleness-bounded rollout executor's scheduling logic, with fake episodes."""

import asyncio
import itertools

import pytest

from hpcrl.rollout.executor import RolloutExecutor


class Episodes:
    """Episodes that finish when the test releases them; records when each started."""

    def __init__(self):
        self.started: list[int] = []
        self.release: dict[int, asyncio.Event] = {}

    async def __call__(self, row: int) -> int:
        self.started.append(row)
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
            eps, itertools.count(), batch_size=2, max_concurrent=10, max_staleness=0, accept=lambda r: r % 2 == 0
        )
        ex.start()
        await settle()
        eps.finish(0, 1)
        await settle()
        assert eps.started == [0, 1, 2], "the rejected group 1 is replaced"
        eps.finish(2)
        assert await ex.next_batch() == [0, 2]
        assert ex.rejected_total == 1
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
        assert sorted(ex.unbatched_rows()) == [2, 3], "3 waits accepted, 2 is in flight"
        await ex.close()

    run(scenario())


def test_a_restored_executor_goes_on_with_the_checkpoints_version_and_counts():
    async def scenario():
        eps = Episodes()
        ex = RolloutExecutor(eps, itertools.count(10), batch_size=2, max_concurrent=100, max_staleness=1)
        ex.restore(version=3, batches_trained=3, rejected_total=5)
        ex.start()
        await settle()
        assert eps.started == [10, 11, 12, 13], "capacity as after 3 batches: this batch and the next"
        assert ex.rejected_total == 5
        await ex.close()

    run(scenario())


class Flaky(Exception):
    """Stands for an inference error after the client's retries."""


def test_a_tolerated_episode_error_drops_its_group_and_the_rollout_goes_on():
    async def scenario():
        async def episode(row: int) -> int:
            if row in (1, 2):
                raise Flaky(f"row {row}")
            return row

        ex = RolloutExecutor(
            episode, itertools.count(), batch_size=2, max_concurrent=2, max_staleness=0, tolerated=(Flaky,)
        )
        ex.start()
        assert await ex.next_batch() == [0, 3], "the failed rows' groups are dropped, replacements start"
        assert ex.failed_total == 2
        await ex.close()

    run(scenario())


def test_many_tolerated_failures_in_a_row_fail_the_run_with_the_last_error():
    async def scenario():
        async def episode(row: int) -> int:
            raise Flaky(f"server said 503 for row {row}")

        ex = RolloutExecutor(
            episode, itertools.count(), batch_size=2, max_concurrent=2, max_staleness=0, tolerated=(Flaky,)
        )
        ex.start()
        with pytest.raises(RuntimeError, match=r"4 episodes in a row failed; the last: server said 503"):
            await ex.next_batch()
        await ex.close()

    run(scenario())


def test_an_error_that_is_not_tolerated_fails_the_run_at_once():
    async def scenario():
        async def episode(row: int) -> int:
            raise KeyError("a bug")

        ex = RolloutExecutor(
            episode, itertools.count(), batch_size=2, max_concurrent=2, max_staleness=0, tolerated=(Flaky,)
        )
        ex.start()
        with pytest.raises(KeyError):
            await ex.next_batch()
        assert ex.failed_total == 0
        await ex.close()

    run(scenario())
