"""bench/controller_overhead.py: the split of a step's time from a timeline, and a real job (slow)."""

import asyncio

import _timeline
import pytest
from controller_overhead import push_parts_ms, split_steps, union_within

from tests.bench.conftest import assert_table


def test_union_merges_overlaps_and_clips_to_the_window():
    assert union_within([(0, 2), (1, 3), (5, 7), (9, 12)], 1, 10) == [(1, 3), (5, 7), (9, 10)]
    assert union_within([(0, 1)], 2, 3) == []


def test_a_step_splits_into_generation_or_training_sync_and_controller():
    timeline = [
        ["step", 0.0, 10.0, 1],
        ["gen", 0.0, 4.0, None],
        ["gen", 1.0, 5.0, None],  # concurrent requests count once
        ["reward", 4.5, 6.0, None],  # 5..6 is the controller alone, in a reward call
        ["judge", 4.6, 5.4, None],  # the reward call's batched request to the reward model's servers
        ["judge", 5.2, 5.8, None],  # another, overlapping it: counted once
        ["train", 6.5, 8.0, None],
        ["sync", 8.0, 9.5, None],
        ["gen", 11.0, 12.0, None],  # after the step: not counted
    ]
    split = split_steps(timeline)
    assert split["total"] == pytest.approx(10.0)
    assert split["gen_or_train"] == pytest.approx(5.0 + 1.5)
    assert split["sync_only"] == pytest.approx(1.5)
    assert split["controller"] == pytest.approx(2.0)  # 5..6.5 and 9.5..10
    assert split["reward"] == pytest.approx(1.0)
    assert split["judge"] == pytest.approx(1.2)  # 4.6..5.8, apart from the other parts


def test_the_timeline_times_each_batched_request_to_the_reward_model(monkeypatch):
    from hpcrl.reward.model_client import RewardModelClient

    wrapped = []
    monkeypatch.setattr(
        _timeline, "timed", lambda cls, method, kind, step_arg=False: wrapped.append((cls, method, kind))
    )
    monkeypatch.setattr(_timeline, "timed_train_step", lambda cls: None)
    _timeline.install()
    assert (RewardModelClient, "_send", "judge") in wrapped
    assert callable(RewardModelClient._send), "the method the timeline wraps is there"


def test_the_loops_work_between_two_steps_counts_as_the_controllers():
    timeline = [
        ["step", 0.0, 4.0, 1],
        ["gen", 0.0, 3.0, None],
        ["step", 5.0, 8.0, 2],  # 4..5: the metrics line and the progress line of step 1, nothing in flight
        ["gen", 4.5, 7.0, None],  # sent before step 2 began: generation from 4.5
        ["train", 7.0, 8.0, None],
        ["gen", 9.0, 10.0, None],  # after the last step: not counted
    ]
    split = split_steps(timeline)
    assert split["total"] == pytest.approx(8.0)
    assert split["gen_or_train"] == pytest.approx(3.0 + 3.5)
    assert split["controller"] == pytest.approx(1.0 + 0.5)  # 3..4 and 4..4.5


def test_the_export_at_the_end_of_a_train_call_counts_as_the_weight_sync_not_as_training(monkeypatch):
    class Trainers:
        async def train_step(self, shards, export_to=""):
            await asyncio.sleep(0.2)
            return {"loss": 1.0, "time_weights_export_s": 0.05} if export_to else {"loss": 1.0}

    monkeypatch.setattr(_timeline, "INTERVALS", [])
    _timeline.timed_train_step(Trainers)

    async def step() -> None:
        await Trainers().train_step([])  # an earlier update of the step: no export
        await Trainers().train_step([], "/w/v1")

    asyncio.run(step())
    (_, a0, a1, _), (_, b0, b1, _), export, sync = _timeline.INTERVALS
    kinds = [kind for kind, *_ in _timeline.INTERVALS]
    assert kinds == ["train", "train", "export", "sync"]
    assert a1 - a0 >= 0.2, "a call without an export is all training"
    assert b1 - b0 >= 0.149, "the call that exported is training but for its last 0.05 s"
    assert export[1] == sync[1] == b1 and export[2] == sync[2] == pytest.approx(b1 + 0.05)
    timeline = [["step", a0, sync[2] + 0.01, 1], *_timeline.INTERVALS]
    assert split_steps(timeline)["sync_only"] == pytest.approx(0.05)
    assert push_parts_ms(timeline)["export"] == pytest.approx(50.0)


@pytest.mark.slow
def test_controller_overhead_bench_times_a_real_job(run_bench):
    out = run_bench("controller_overhead")
    rows = assert_table(out, "job", "gen or train", "weight sync", "controller", "neither")
    assert rows[0][0] == "max_staleness=0"
    shares = [float(c) for c in rows[0][2:5]]
    assert sum(shares) == pytest.approx(1.0, abs=0.01)
    assert "neither generation nor training" in out
