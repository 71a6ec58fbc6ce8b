"""The training rows' order and its saved position: a resumed run draws what an uninterrupted one would."""

import asyncio
import itertools

import pytest

from hpcrl.controller.rows import TrainingRows
from hpcrl.rollout.executor import RolloutExecutor

ROWS = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(7)]


def draw(rows: TrainingRows, n: int) -> list[dict]:
    return list(itertools.islice(rows, n))


def test_every_epoch_is_a_fresh_permutation_fixed_by_the_seed():
    first = draw(TrainingRows(ROWS, seed=3), 3 * len(ROWS))
    assert [row.pop("draw") for row in first] == list(range(3 * len(ROWS))), "each row carries its draw number"
    epochs = [first[i : i + len(ROWS)] for i in range(0, len(first), len(ROWS))]
    key = lambda row: row["prompt"]  # noqa: E731
    assert all(sorted(e, key=key) == sorted(ROWS, key=key) for e in epochs)
    assert epochs[0] != epochs[1], "reshuffled every epoch"
    without_draw = lambda rows: [{k: v for k, v in r.items() if k != "draw"} for r in rows]  # noqa: E731
    assert without_draw(draw(TrainingRows(ROWS, seed=3), len(first))) == first
    assert without_draw(draw(TrainingRows(ROWS, seed=4), len(first))) != first


@pytest.mark.parametrize("position", [0, 5, 7, 16])  # inside, at and across epoch boundaries
def test_a_restored_position_goes_on_as_the_uninterrupted_order(position):
    uninterrupted = draw(TrainingRows(ROWS, seed=1), position + 20)
    saved = TrainingRows(ROWS, seed=1)
    draw(saved, position)
    resumed = TrainingRows(ROWS, seed=1)
    resumed.restore(saved.state(unbatched=[]))
    assert draw(resumed, 20) == uninterrupted[position:]


def test_rows_not_trained_on_at_the_checkpoint_are_drawn_again_first():
    saved = TrainingRows(ROWS, seed=1)
    drawn = draw(saved, 5)
    resumed = TrainingRows(ROWS, seed=1)
    resumed.restore(saved.state(unbatched=drawn[3:]))  # rows 3 and 4 were still in flight
    assert draw(resumed, 4) == [*drawn[3:], *draw(saved, 2)]


def test_a_checkpoint_of_another_dataset_or_seed_is_refused():
    state = TrainingRows(ROWS, seed=1).state(unbatched=[])
    with pytest.raises(ValueError, match=r"7 training rows shuffled with run\.seed=1.*6 rows and run\.seed=1"):
        TrainingRows(ROWS[:6], seed=1).restore(state)
    with pytest.raises(ValueError, match=r"run\.seed=2"):
        TrainingRows(ROWS, seed=2).restore(state)


async def trained_rows(rows: TrainingRows, batches: int, executor_state=None) -> tuple[list, RolloutExecutor]:
    """Rows of the groups of ``batches`` batches from an executor running ahead (staleness 1); each episode's
    group is its row, and episodes end out of the order they start in (a row's own number of event-loop turns)."""

    async def episode(row):
        for _ in range(3 * (int(row["answer"]) % 3)):
            await asyncio.sleep(0)
        return row

    ex = RolloutExecutor(episode, rows, batch_size=3, max_concurrent=4, max_staleness=1)
    if executor_state:
        ex.restore(*executor_state)
    ex.start()
    trained = []
    for _ in range(batches):
        trained += await ex.next_batch()
        ex.set_version(ex.version + 1)
        await asyncio.sleep(0)  # the train step and the weight sync: the rollout runs meanwhile
    return trained, ex


def test_a_run_resumed_from_a_checkpoint_trains_on_the_rows_of_an_uninterrupted_run():
    async def scenario():
        uninterrupted, ex = await trained_rows(TrainingRows(ROWS, seed=5), batches=6)
        await ex.close()

        rows = TrainingRows(ROWS, seed=5)
        before, ex = await trained_rows(rows, batches=2)
        state = rows.state(ex.unbatched_rows())  # the checkpoint after step 2, the rollout running ahead
        assert state["replay"], "some drawn rows were not trained on yet"
        await ex.close()  # the crash
        resumed = TrainingRows(ROWS, seed=5)
        resumed.restore(state)
        after, ex = await trained_rows(resumed, batches=4, executor_state=(2, 2, {}))
        await ex.close()
        assert before + after == uninterrupted

    asyncio.run(asyncio.wait_for(scenario(), 30))
