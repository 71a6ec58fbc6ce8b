"""Which engine a rank builds: the policy's from model.path; the critic's from model.critic_path, else the policy's,
at train.critic_lr."""

from dataclasses import replace

from hpcrl.config.schema import Config
from hpcrl.train.engine import Engine
from hpcrl.train.value_engine import ValueEngine
from hpcrl.train.worker import _engine


def test_the_critic_starts_from_critic_path_else_the_policy_and_trains_at_its_own_lr():
    cfg = Config()
    cfg = replace(cfg, model=replace(cfg.model, path="/models/policy"), train=replace(cfg.train, critic_lr=7e-3))
    policy, critic = _engine("trainer", cfg, None), _engine("critic", cfg, None)
    assert type(policy) is Engine and str(policy.model_path) == "/models/policy" and policy.train.lr == cfg.train.lr
    assert isinstance(critic, ValueEngine) and str(critic.model_path) == "/models/policy"
    assert critic.train.lr == 7e-3
    own = replace(cfg, model=replace(cfg.model, critic_path="/runs/x/final_critic"))
    assert str(_engine("critic", own, None).model_path) == "/runs/x/final_critic"
