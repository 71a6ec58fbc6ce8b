"""The loop with a critic, with fake workers: the critic's values come before the actor's first update and at the
same time as decoupled PPO's proximal logprobs; both train on the same parts of the batch, each sequence with
its GAE advantages, returns and old values; the critic's metrics come back prefixed."""

import asyncio
from dataclasses import replace

import pytest

from hpcrl.config.schema import Config
from tests.controller.test_loop import PolicyTrainers, make_loop, sequence

DEADLINE_S = 5.0


class OverlapTrainers(PolicyTrainers):
    """Its proximal logprobs wait until the critic's values have started: they only come if both run at once."""

    def __init__(self, values_started: asyncio.Event):
        super().__init__()
        self.values_started = values_started
        self.parts: list[list[list[int]]] = []

    async def compute_logprobs(self, shards):
        await asyncio.wait_for(self.values_started.wait(), DEADLINE_S)
        return await super().compute_logprobs(shards)

    async def train_step(self, shards, export_to=""):
        for part in shards:
            for s in part:
                assert s.token_advantages is not None and s.returns is not None, "GAE came before the update"
        self.parts.append(sorted(s.input_ids for part in shards for s in part))
        return await super().train_step(shards, export_to)


class FakeCritics:
    """A critic whose value of every state is 0.25; records what it trained on."""

    world_size = 3

    def __init__(self, trainers: OverlapTrainers, values_started: asyncio.Event):
        self.trainers, self.values_started = trainers, values_started
        self.parts: list[list[list[int]]] = []
        self.updates_seen_at_values = None

    async def values(self, shards):
        self.values_started.set()
        self.updates_seen_at_values = self.trainers.updates
        await asyncio.sleep(0.05)  # the proximal logprobs run meanwhile
        return [[[0.0] + [0.25] * (len(s.input_ids) - 1) for s in part] for part in shards]

    async def train_step(self, shards, export_to=""):
        rows = [s for part in shards for s in part]
        assert all(s.old_values[1:] == [0.25] * (len(s.input_ids) - 1) for s in rows), "the values it gave"
        self.parts.append(sorted(s.input_ids for s in rows))
        return {"loss": 0.5, "grad_norm": 1.0, "lr": 1e-3, "clip_frac": 0.1, "tokens": 99.0}


def test_the_critics_values_come_first_beside_the_proximal_logprobs_and_both_train_on_the_same_parts(tmp_path):
    cfg = Config()
    cfg.algorithm = replace(cfg.algorithm, advantage="gae", behavior_weight_cap=5.0, updates_per_batch=2)

    async def run():
        started = asyncio.Event()
        trainers = OverlapTrainers(started)
        critics = FakeCritics(trainers, started)
        loop = make_loop(tmp_path, cfg, trainers=trainers, critics=critics)
        metrics = {}
        batch = [replace(sequence(n), input_ids=[n] * n) for n in (3, 4, 5, 6)]
        results = await loop._train_on(batch, [2, 2], [1.0, 0.0, 1.0, 0.0], metrics, step=1)
        return trainers, critics, results, metrics

    trainers, critics, results, metrics = asyncio.run(run())
    assert critics.updates_seen_at_values == 0, "values before the actor's first update"
    assert trainers.parts == critics.parts and len(critics.parts) == 2, "the same two parts, one update each"
    assert set(trainers.prox_seen[0]) == {-1.0}
    for result in results:
        assert result["critic_loss"] == 0.5 and result["critic_clip_frac"] == 0.1 and result["loss"] == 0.0
        assert "critic_tokens" not in result
    assert metrics["critic_value_mean"] == pytest.approx(0.25) and "critic_explained_var" in metrics
