"""The rollout/trainer mismatch of a batch: the gap between the servers' behaviour logprobs and the trainer's before
the step's first update, over loss tokens only, logged with decoupled PPO's proximal logprobs."""

import asyncio
import math
from dataclasses import replace

import pytest

from hpcrl.config.schema import Config
from hpcrl.controller.mismatch import batch_mismatch
from tests.controller.test_loop import PolicyTrainers, make_loop, sequence


def test_a_batch_of_two_lengths_is_measured_on_its_loss_tokens_only():
    # lengths 3 and 2; token 0 is the prompt (mask 0), whose logprobs are junk that must not count
    short = replace(sequence(2), old_logprobs=[9.0, -1.0], prox_logprobs=[-9.0, -1.0 + math.log(3)])
    long = replace(sequence(3), old_logprobs=[9.0, -2.0, -1.0], prox_logprobs=[-9.0, -2.0 - 0.5, -1.0 + 0.25])
    got = batch_mismatch([long, short])
    d = [-0.5, 0.25, math.log(3)]  # the loss tokens' trainer - behaviour
    assert got["mismatch_abs_mean"] == pytest.approx(sum(map(abs, d)) / 3)
    assert got["mismatch_abs_max"] == pytest.approx(math.log(3))
    assert got["mismatch_kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert got["mismatch_out_frac"] == pytest.approx(1 / 3), "a ratio of 3 leaves [1/2, 2]"
    assert got["mismatch_seq_out_frac"] == pytest.approx(1 / 2)
    assert got["mismatch_seq_log_ratio"] == pytest.approx((-0.5 + 0.25 + math.log(3)) / 2)


def test_without_the_trainers_logprobs_there_is_nothing_to_measure():
    assert batch_mismatch([sequence(3)]) == {}
    assert batch_mismatch([]) == {}


def test_decoupled_ppo_logs_the_mismatch_of_the_policy_before_its_first_update(tmp_path):
    cfg = Config()
    cfg.algorithm = replace(cfg.algorithm, behavior_weight_cap=5.0, updates_per_batch=2)
    loop = make_loop(tmp_path, cfg, trainers=PolicyTrainers())
    metrics = {}
    batch = [sequence(n) for n in (3, 4, 5, 6)]  # behaviour -0.5 on every token; the policy before updates: -1.0
    asyncio.run(loop._train_on(batch, [2, 2], [1.0] * 4, metrics, step=1))
    assert metrics["mismatch_abs_mean"] == metrics["mismatch_abs_max"] == pytest.approx(0.5)
    assert metrics["mismatch_kl_k3"] == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert metrics["mismatch_out_frac"] == 0.0
    assert metrics["mismatch_seq_log_ratio"] == pytest.approx(-0.5 * (2 + 3 + 4 + 5) / 4)
