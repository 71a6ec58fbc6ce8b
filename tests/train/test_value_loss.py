"""The clipped value loss, its gradient and clip fraction, and explained variance, against hand-computed values."""

import math

import pytest
import torch

from hpcrl.train.algorithms.value import clipped_value_error, explained_variance, value_loss

F64 = torch.float64
CLIP = 0.2


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual, expected, atol=1e-12) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0
    )


# Three tokens with old value 0 and clip 0.2 (clip range [-0.2, 0.2]), and a padding token:
#   a: v = 0.1,  R = 1: inside the range, both terms (0.1 - 1)^2 = 0.81         -> 0.5 * 0.81 = 0.405, not clipped
#   b: v = 0.5,  R = 1: clipped to 0.2, (0.2 - 1)^2 = 0.64 > (0.5 - 1)^2 = 0.25 -> 0.5 * 0.64 = 0.32, CLIPPED
#   c: v = -0.5, R = 1: clipped to -0.2, (-0.2 - 1)^2 = 1.44 < (-0.5 - 1)^2 = 2.25 -> 0.5 * 2.25 = 1.125, not clipped
# token_mean: (0.405 + 0.32 + 1.125) / 3 = 1.85 / 3; clip fraction 1 / 3.
VALUES = [[0.1, 0.5, -0.5, math.nan]]
OLD = [[0.0, 0.0, 0.0, 0.0]]
RETURNS = [[1.0, 1.0, 1.0, 0.0]]
MASK = [[1, 1, 1, 0]]


def test_clipped_value_error_hand_example():
    per_token, clipped = clipped_value_error(t(VALUES)[:, :3], t(OLD)[:, :3], t(RETURNS)[:, :3], CLIP)
    close(per_token, [[0.405, 0.32, 1.125]])
    assert clipped.tolist() == [[False, True, False]]


def test_value_loss_hand_example_and_exact_clip_fraction():
    loss, fraction = value_loss(t(VALUES), t(OLD), t(RETURNS), t(MASK), CLIP)
    close(loss, 1.85 / 3)
    assert fraction.item() == 1 / 3  # exactly 1 of 3 masked tokens, the NaN pad not counted
    assert not fraction.requires_grad


def test_gradient_is_zero_where_the_clipped_term_is_active_and_larger():
    values = t(VALUES).requires_grad_()
    loss, _ = value_loss(values, t(OLD), t(RETURNS), t(MASK), CLIP)
    (grad,) = torch.autograd.grad(loss, values)
    # d/dv 0.5 * (v - R)^2 = v - R, divided by the 3 masked tokens; b is clipped (0); the NaN pad gets 0
    close(grad, [[(0.1 - 1) / 3, 0.0, (-0.5 - 1) / 3, 0.0]])


def test_no_clipping_where_it_does_not_bind():
    # every value within 0.2 of its old value: the loss is plain 0.5 * MSE, nothing clipped
    values, old, returns = t([[0.1, -0.15, 0.3]]), t([[0.0, 0.0, 0.2]]), t([[1.0, -1.0, 0.5]])
    loss, fraction = value_loss(values, old, returns, t([[1, 1, 1]]), CLIP)
    close(loss, 0.5 * (0.81 + 0.7225 + 0.04) / 3)
    assert fraction.item() == 0.0
    # and with clipping turned off, the hand example's token b counts its unclipped 0.5 * 0.25
    loss, fraction = value_loss(t(VALUES), t(OLD), t(RETURNS), t(MASK), math.inf)
    close(loss, (0.405 + 0.125 + 1.125) / 3)
    assert fraction.item() == 0.0


def test_value_loss_is_aggregated_like_the_actor_loss():
    # row 0: the hand example (sum 1.85 over 3 tokens); row 1: one token, v = 0, R = 2 -> 0.5 * 4 = 2
    values = t([VALUES[0], [0.0, 0.0, 0.0, 0.0]])
    returns = t([RETURNS[0], [2.0, 0.0, 0.0, 0.0]])
    mask = t([MASK[0], [1, 0, 0, 0]])
    old = torch.zeros_like(values)
    token_mean, fraction = value_loss(values, old, returns, mask, CLIP, "token_mean")
    close(token_mean, (1.85 + 2) / 4)
    assert fraction.item() == 0.25
    close(value_loss(values, old, returns, mask, CLIP, "seq_mean_token_mean")[0], (1.85 / 3 + 2 / 1) / 2)
    close(value_loss(values, old, returns, mask, CLIP, "seq_mean_token_sum_norm", max_tokens=8)[0], (3.85 / 8) / 2)
    # a global normaliser (micro-batches, ranks) replaces this batch's own count
    close(value_loss(values, old, returns, mask, CLIP, "token_mean", global_normalizer=10)[0], 3.85 / 10)


def test_value_clip_must_be_positive():
    with pytest.raises(ValueError, match="value clip must be > 0"):
        value_loss(t(VALUES), t(OLD), t(RETURNS), t(MASK), 0.0)


# ---------------------------------------------------------------- explained variance

RET = [[1.0, 2.0, 3.0, 99.0], [4.0, -7.0, 0.0, 0.0]]  # masked returns 1, 2, 3, 4: mean 2.5, variance 1.25
EV_MASK = [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_explained_variance_is_one_for_perfect_values():
    assert explained_variance(t(RET), t(RET), t(EV_MASK)) == 1.0


def test_explained_variance_is_zero_for_values_that_only_know_the_mean():
    values = torch.full((2, 4), 2.5, dtype=F64)
    assert explained_variance(values, t(RET), t(EV_MASK)) == pytest.approx(0.0, abs=1e-12)


def test_explained_variance_is_negative_for_bad_values():
    # values 4, 3, 2, 1: errors -3, -1, 1, 3 with variance 5 -> 1 - 5 / 1.25 = -3
    values = t([[4.0, 3.0, 2.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert explained_variance(values, t(RET), t(EV_MASK)) == pytest.approx(-3.0, abs=1e-12)


def test_explained_variance_ignores_padding_and_is_nan_when_undefined():
    values = t([[1.0, 2.0, 3.0, math.nan], [4.0, math.inf, 0.0, 0.0]])
    assert explained_variance(values, t(RET), t(EV_MASK)) == 1.0
    assert math.isnan(explained_variance(t([[0.3, 0.4]]), t([[0.1, 0.1]]), t([[1, 1]])))  # equal returns
    assert math.isnan(explained_variance(t(RET), t(RET), torch.zeros(2, 4)))  # no masked token
