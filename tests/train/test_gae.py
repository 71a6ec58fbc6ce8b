"""GAE advantages and returns, outcome reward placement and whitening against hand-computed values."""

import math

import pytest
import torch

from hpcrl.train.algorithms.gae import gae_advantages, last_token_index, outcome_token_rewards, whiten

F64 = torch.float64
GAMMA, LAM = 0.9, 0.8


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual, expected, atol=1e-12) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0
    )


# The 4-token episode: reward 1 on the last token, values 0.5, 0.6, 0.7, 0.8, gamma 0.9, lambda 0.8.
# TD errors, delta_t = r_t + gamma * V_{t+1} - V_t, with V_4 = 0 (the episode ends after token 3):
#   delta_3 = 1 + 0.9 * 0   - 0.8 = 0.2
#   delta_2 = 0 + 0.9 * 0.8 - 0.7 = 0.02
#   delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03
#   delta_0 = 0 + 0.9 * 0.6 - 0.5 = 0.04
# Advantages, A_t = delta_t + gamma * lambda * A_{t+1}, gamma * lambda = 0.72:
#   A_3 = 0.2
#   A_2 = 0.02 + 0.72 * 0.2     = 0.164
#   A_1 = 0.03 + 0.72 * 0.164   = 0.14808
#   A_0 = 0.04 + 0.72 * 0.14808 = 0.1466176
# Returns, A_t + V_t: 1.0, 0.864, 0.74808, 0.6466176.
REWARDS = [0.0, 0.0, 0.0, 1.0]
VALUES = [0.5, 0.6, 0.7, 0.8]
ADVANTAGES = [0.1466176, 0.14808, 0.164, 0.2]
RETURNS = [0.6466176, 0.74808, 0.864, 1.0]


def test_four_token_episode_hand_computed():
    advantages, returns = gae_advantages(t([REWARDS]), t([VALUES]), t([[1, 1, 1, 1]]), GAMMA, LAM)
    close(advantages, [ADVANTAGES])
    close(returns, [RETURNS])


def test_returns_are_the_lambda_returns():
    # the same numbers by the other definition: G_t = r_t + gamma * ((1 - lambda) * V_{t+1} + lambda * G_{t+1})
    # G_3 = 1; G_2 = 0.9 * (0.2 * 0.8 + 0.8 * 1) = 0.864; G_1 = 0.9 * (0.2 * 0.7 + 0.8 * 0.864) = 0.74808;
    # G_0 = 0.9 * (0.2 * 0.6 + 0.8 * 0.74808) = 0.6466176
    expected, following = [0.0] * 4, 0.0
    for step in reversed(range(4)):
        next_value = VALUES[step + 1] if step < 3 else 0.0
        following = REWARDS[step] + GAMMA * ((1 - LAM) * next_value + LAM * following)
        expected[step] = following
    close(expected, RETURNS)
    _, returns = gae_advantages(t([REWARDS]), t([VALUES]), t([[1, 1, 1, 1]]), GAMMA, LAM)
    close(returns, [expected])


def test_right_padding_and_prompt_columns_change_nothing_and_read_zero():
    # row 0: two prompt columns (mask 0), the episode, two padding columns holding garbage values
    # row 1: a 2-token episode, reward -1, values 0.3 and -0.2, padded to the same width
    nan = math.nan
    rewards = t([[0, 0, *REWARDS, 0, 0], [0, -1, 0, 0, 0, 0, 0, 0]])
    values = t([[9, 9, *VALUES, nan, 7], [0.3, -0.2, nan, 5, 5, 5, 5, 5]])
    mask = t([[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    advantages, returns = gae_advantages(rewards, values, mask, GAMMA, LAM)
    close(advantages[0, 2:6], ADVANTAGES)
    close(returns[0, 2:6], RETURNS)
    alone_adv, alone_ret = gae_advantages(t([[0, -1]]), t([[0.3, -0.2]]), t([[1, 1]]), GAMMA, LAM)
    close(advantages[1, :2], alone_adv[0])
    close(returns[1, :2], alone_ret[0])
    # row 1 by hand: delta_1 = -1 - (-0.2) = -0.8; delta_0 = 0.9 * -0.2 - 0.3 = -0.48; A_0 = -0.48 + 0.72 * -0.8
    close(alone_adv, [[-0.48 - 0.576, -0.8]])
    padding = mask == 0
    assert (advantages[padding] == 0).all() and (returns[padding] == 0).all()


def test_tool_output_between_turns_is_skipped_not_a_step():
    # the episode's tokens split by three masked tool-output tokens with values of their own: the recursion
    # carries V and A across them, so the response tokens get the 4-token episode's numbers
    rewards = t([[0, 0, 0, 0, 0, 0, 1]])
    values = t([[0.5, 0.6, 3.0, -2.0, 4.0, 0.7, 0.8]])
    mask = t([[1, 1, 0, 0, 0, 1, 1]])
    advantages, returns = gae_advantages(rewards, values, mask, GAMMA, LAM)
    close(advantages, [[0.1466176, 0.14808, 0, 0, 0, 0.164, 0.2]])
    close(returns, [[0.6466176, 0.74808, 0, 0, 0, 0.864, 1.0]])


def test_gamma_and_lambda_one_with_zero_values_give_the_reward_at_every_token():
    mask = t([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    rewards = outcome_token_rewards(t([0.75, -2.0]), mask)
    advantages, returns = gae_advantages(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
    close(returns, [[0, 0.75, 0.75, 0.75, 0], [-2, -2, 0, 0, 0]])
    close(advantages, returns)


def test_lambda_zero_is_the_one_step_td_error():
    advantages, _ = gae_advantages(t([REWARDS]), t([VALUES]), t([[1, 1, 1, 1]]), GAMMA, 0.0)
    close(advantages, [[0.04, 0.03, 0.02, 0.2]])  # the deltas of the hand example


def test_outputs_carry_no_gradient():
    values = t([VALUES]).requires_grad_()
    advantages, returns = gae_advantages(t([REWARDS]), values, t([[1, 1, 1, 1]]), GAMMA, LAM)
    assert not advantages.requires_grad and not returns.requires_grad


def test_outcome_reward_sits_on_the_last_response_token():
    mask = t([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    assert last_token_index(mask)[0].tolist() == [4, 5, 0]
    assert last_token_index(mask)[1].tolist() == [True, True, False]
    rewards = outcome_token_rewards(t([2.0, -1.0, 5.0]), mask)
    close(rewards, [[0, 0, 0, 0, 2, 0], [0, 0, 0, 0, 0, -1], [0, 0, 0, 0, 0, 0]])  # no token: no reward
    assert outcome_token_rewards(torch.tensor([1, 0]), mask[:2]).dtype == torch.float32


def test_bad_input_is_refused():
    mask = t([[1, 1, 0]])
    with pytest.raises(ValueError, match="non-zero at positions where mask is 0"):
        gae_advantages(t([[0, 0, 1]]), t([[0, 0, 0]]), mask, GAMMA, LAM)  # this reward would be lost
    with pytest.raises(ValueError, match="one shape"):
        gae_advantages(t([[0, 1]]), t([[0, 0, 0]]), mask, GAMMA, LAM)
    with pytest.raises(ValueError, match="lam must be in"):
        gae_advantages(t([[0, 1, 0]]), t([[0, 0, 0]]), mask, GAMMA, 1.5)
    with pytest.raises(ValueError, match=r"scores must be \[batch=1\]"):
        outcome_token_rewards(t([1.0, 2.0]), mask)


# ---------------------------------------------------------------- whitening


def test_whiten_over_the_batch_hand_example():
    # masked entries 1, 2, 3, 4: mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    x = t([[1, 2, 3, 100], [4, -50, 0, 0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    std = math.sqrt(1.25)
    centered = [[-1.5 / std, -0.5 / std, 0.5 / std, 0], [1.5 / std, 0, 0, 0]]
    close(whiten(x, mask, eps=0.0), centered)
    shifted_back = [[-1.5 / std + 2.5, -0.5 / std + 2.5, 0.5 / std + 2.5, 0], [1.5 / std + 2.5, 0, 0, 0]]
    close(whiten(x, mask, eps=0.0, shift_mean=False), shifted_back)
    close(whiten(x, mask, eps=0.5)[0, 0], -1.5 / (std + 0.5))  # eps is added to the std


def test_whiten_gives_exact_zero_for_equal_entries_and_ignores_nan_padding():
    x = t([[0.1, 0.1, math.nan], [0.1, 0.1, 0.1]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    assert (whiten(x, mask) == 0).all()
    close(whiten(x, mask, shift_mean=False), [[0.1, 0.1, 0], [0.1, 0.1, 0.1]])
    assert (whiten(x, torch.zeros_like(mask)) == 0).all()
