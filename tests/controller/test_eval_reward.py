"""eval.reward_fn: held-out accuracy scored by a reward of its own, beside the training reward."""

import asyncio
from dataclasses import replace

import pytest

from hpcrl.config.errors import ConfigError
from hpcrl.config.preflight import check_rewards, row_rewards
from hpcrl.config.schema import Config
from hpcrl.controller.evaluate import eval_reward_pool
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.registry import RewardFns

EXACT = "hpcrl.reward.builtin:mod10"


def with_eval_reward(spec: str, **workflow) -> Config:
    cfg = Config()
    return replace(cfg, eval=replace(cfg.eval, reward_fn=spec), workflow=replace(cfg.workflow, **workflow))


def test_without_eval_reward_fn_the_runs_reward_scores_the_held_out_rows():
    with RewardPool(EXACT) as run_pool:
        assert eval_reward_pool(Config(), run_pool) is None


def test_eval_reward_fn_scores_with_its_own_function_and_the_runs_reward_model_servers():
    with RewardPool("tests.reward.fixtures:here_length") as run_pool:
        run_pool.use_reward_model(["127.0.0.1:1", "127.0.0.1:2"])
        with eval_reward_pool(with_eval_reward(EXACT), run_pool) as pool:
            items = [("3+4=", "7", "7"), ("3+4=", "71", "7"), ("3+4=", "8", "7")]
            assert [o.value for o in asyncio.run(pool.score(items))] == [1.0, 1.0, 0.0]  # mod10, not the length
            assert [o.value for o in asyncio.run(run_pool.score(items))] == [1.0, 2.0, 1.0]
            assert pool._link.addresses == ["127.0.0.1:1", "127.0.0.1:2"]  # a model reward there would ask them


def test_the_rows_carry_the_columns_the_held_out_reward_takes():
    cfg = with_eval_reward("tests.reward.fixtures:in_range")
    rewards = row_rewards(cfg, RewardFns.resolve(EXACT))
    assert rewards.columns() == ("low", "high")
    assert rewards.weights == (1.0, 0.0), "the held-out reward is never part of the training reward's sum"


def test_a_plug_in_workflow_refuses_eval_reward_fn():
    cfg = with_eval_reward(EXACT, name="hpcrl.rollout.agents.mod10:episode")
    with pytest.raises(ConfigError, match=r"eval\.reward_fn.*plug-in workflow"):
        check_rewards(cfg)
