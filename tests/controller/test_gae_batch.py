"""``apply_gae``: the critic's values (aligned with input_ids) to per-token advantages, returns and old values on
the trainer's sequences, checked against hand-computed numbers for a 4-token episode behind a 2-token prompt."""

import math

import pytest

from hpcrl.config.schema import AlgorithmConfig
from hpcrl.controller.batch import apply_gae, to_sequences
from hpcrl.rpc.messages import SequenceData

CFG = AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.8)


def seq(mask: list[int]) -> SequenceData:
    n = len(mask)
    return SequenceData(list(range(3, 3 + n)), mask, 0.0, [-0.5] * n, None, None, [-1] * n)


def test_four_token_episode_behind_a_prompt_hand_computed():
    sequences = [seq([0, 0, 1, 1, 1, 1])]
    values = [[0.0, 0.3, 0.5, 0.6, 0.7, 0.8]]  # entry 1 (a prompt token) is not a step: it must not count
    stats = apply_gae(sequences, [1.0], values, CFG)
    # delta = r + 0.9 V(next) - V; A = delta + 0.72 A(next); the reward 1.0 sits on the last token
    deltas = [0.9 * 0.6 - 0.5, 0.9 * 0.7 - 0.6, 0.9 * 0.8 - 0.7, 1.0 - 0.8]
    advantages = [0.0] * 4
    running = 0.0
    for i in reversed(range(4)):
        running = deltas[i] + 0.72 * running
        advantages[i] = running
    assert advantages == pytest.approx([0.1466176, 0.14808, 0.164, 0.2])
    returns = [a + v for a, v in zip(advantages, [0.5, 0.6, 0.7, 0.8], strict=True)]
    (out,) = sequences
    assert out.returns == pytest.approx([0.0, 0.0, *returns], abs=1e-6)
    assert out.old_values == pytest.approx([0.0, 0.0, 0.5, 0.6, 0.7, 0.8])
    mean = sum(advantages) / 4
    std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / 4)
    whitened = [(a - mean) / (std + 1e-6) for a in advantages]
    assert out.token_advantages == pytest.approx([0.0, 0.0, *whitened], abs=1e-4)
    assert stats["critic_value_mean"] == pytest.approx(0.65) and stats["return_mean"] == pytest.approx(sum(returns) / 4)


def test_tokens_between_turns_get_nothing_and_are_skipped():
    """A multi-turn trajectory: feedback tokens (mask 0) between the model's turns are not steps."""
    gapped, plain = seq([0, 1, 0, 0, 1]), seq([0, 1, 1])
    apply_gae([gapped, plain], [1.0, 1.0], [[0, 0.4, 9.0, 9.0, 0.6], [0, 0.4, 0.6]], CFG)
    assert gapped.returns[2:4] == [0.0, 0.0] and gapped.token_advantages[2:4] == [0.0, 0.0]
    # the gap changes nothing: both sequences' two response tokens get the same returns
    assert [gapped.returns[1], gapped.returns[4]] == pytest.approx([plain.returns[1], plain.returns[2]])


def test_explained_variance_is_one_when_the_values_were_the_returns():
    sequences = [seq([0, 1, 1]), seq([0, 1, 1])]
    stats = apply_gae(sequences, [1.0, 0.0], [[0, 1.0, 1.0], [0, 0.0, 0.0]], AlgorithmConfig(gamma=1.0, lam=1.0))
    assert stats["critic_explained_var"] == pytest.approx(1.0)
    assert sequences[0].returns == [0.0, 1.0, 1.0] and sequences[1].returns == [0.0, 0.0, 0.0]


def test_values_of_the_wrong_length_are_refused_naming_the_sequence():
    with pytest.raises(ValueError, match="sequence 1: 2 values for 3 tokens"):
        apply_gae([seq([0, 1, 1]), seq([0, 1, 1])], [1.0, 0.0], [[0, 1, 1], [0, 1]], CFG)


def test_gae_sequences_carry_no_sequence_advantage_before_the_critic():
    from hpcrl.rollout.workflows.base import Group, Sample

    group = Group("p", "a", [1, 2], [Sample([5, 6], [-0.1, -0.2], [0, 0], "stop", reward=1.0)])
    (only,) = to_sequences([group], AlgorithmConfig(advantage="gae", group_size=1))
    assert only.advantage == 0.0 and only.token_advantages is None, "GAE's advantages come from apply_gae"
