"""``policy_loss`` with each off-policy correction (``algorithm.off_policy``) against hand-computed losses, gradients
and metrics, under the aggregations of GRPO, Dr. GRPO, DAPO and PPO, alone and with decoupled PPO's cap.

One small batch serves every test: three sequences of 3, 2 and 4 loss tokens, padding holding junk (NaN current
logprobs, ``-inf`` behaviour, ``+inf`` proximal logprobs) that must reach no loss, gradient or metric. Each token has a
behaviour logprob ``old``, a trainer (proximal) logprob ``prox = old + log rho`` and a current logprob
``logprobs = prox + log r``: ``rho`` is the importance ratio the correction weighs, ``r`` the ratio the clipped
surrogate takes against ``prox``. The expected weights are written out by hand below; the expected loss and
gradient follow from them by the formulas in ``_expected``, which repeat the documented objective in plain Python.
"""

import math

import pytest
import torch

from hpcrl.config.schema import AlgorithmConfig, OffPolicyConfig
from hpcrl.train.algorithms import policy_loss

F64 = torch.float64
KINDS = ("tis", "mis_token", "mis_sequence", "icepop")
MAX_TOKENS = 5  # Dr. GRPO's constant normaliser (rollout.max_new_tokens)
# the algorithms' aggregations (and DAPO's clip-higher): the corrections must compose with each
ALGORITHMS = {
    "grpo": {"loss_agg": "seq_mean_token_mean"},
    "dr_grpo": {"loss_agg": "seq_mean_token_sum_norm"},
    "dapo": {"loss_agg": "token_mean", "clip_high": 0.28},
}

# per loss token (rho = exp(prox - old), r = exp(logprobs - prox)); off_policy's defaults: cap 2, band [1/2, 2]
RHO = [[1.0, 4.0, 0.4], [1.5, 0.25], [1.25, 1.0, 0.8, 1.0]]
R = [[1.0, 1.1, 0.5], [1.0, 0.7], [1.5, 1.0, 0.9, 1.0]]
OLD = [[-1.0, -2.0, -0.5], [-3.0, -0.25], [-1.5, -0.75, -2.5, -1.0]]
ADVANTAGES = [1.0, -2.0, 0.5]  # one per sequence (GRPO); PPO's per-token ones below
TOKEN_ADVANTAGES = [[1.0, -1.0, 2.0], [-2.0, 0.5], [0.5, -0.5, 1.0, -1.0]]
WIDTH = 4
ALL = [[1, 1, 1], [1, 1], [1, 1, 1, 1]]

# (weight, loss mask) by hand; the sequence ratios (products of rho) are 1.6, 0.375 and 1.0
# - tis: min(rho, 2): token (0, 1)'s 4 is truncated to 2; every token stays in the loss
# - mis_token: tokens outside [1/2, 2] (4, 0.4, 0.25) leave the loss and its normaliser; the others weigh rho
# - mis_sequence: sequence 1 (0.375) leaves the loss; the others weigh their sequence ratio on every token
# - icepop: mis_token's weights, but the rejected tokens stay in the normaliser
EXPECTED = {
    "tis": ([[1.0, 2.0, 0.4], [1.5, 0.25], [1.25, 1.0, 0.8, 1.0]], ALL),
    "mis_token": ([[1.0, 0.0, 0.0], [1.5, 0.0], [1.25, 1.0, 0.8, 1.0]], [[1, 0, 0], [1, 0], [1, 1, 1, 1]]),
    "mis_sequence": ([[1.6, 1.6, 1.6], [0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], [[1, 1, 1], [0, 0], [1, 1, 1, 1]]),
    "icepop": ([[1.0, 0.0, 0.0], [1.5, 0.0], [1.25, 1.0, 0.8, 1.0]], ALL),
}
# (off_policy_weight_mean over the kept tokens, off_policy_excluded_frac, off_policy_truncated_frac) of 9 tokens
METRICS = {
    "tis": ((1 + 2 + 0.4 + 1.5 + 0.25 + 1.25 + 1 + 0.8 + 1) / 9, 0.0, 1 / 9),
    "mis_token": ((1 + 1.5 + 1.25 + 1 + 0.8 + 1) / 6, 3 / 9, 0.0),
    "mis_sequence": ((3 * 1.6 + 4 * 1.0) / 7, 2 / 9, 0.0),
    "icepop": ((1 + 1.5 + 1.25 + 1 + 0.8 + 1) / 6, 3 / 9, 0.0),
}

# with behavior_weight_cap 1.4 as well: the cap excludes (weight 0) tokens (0, 1) (rho 4) and (1, 0) (rho 1.5) and
# leaves every loss mask as it was; the rest keep the correction's weight, not that times rho: (2, 0) weighs 1.25
# (not 1.5625), tis' (0, 2) 0.4 (not 0.16), mis_sequence's (0, 0) and (0, 2) 1.6 (not 1.6 and 0.64)
CAP = 1.4
CAPPED = {
    "tis": ([[1.0, 0.0, 0.4], [0.0, 0.25], [1.25, 1.0, 0.8, 1.0]], ALL),
    "mis_token": ([[1.0, 0.0, 0.0], [0.0, 0.0], [1.25, 1.0, 0.8, 1.0]], [[1, 0, 0], [1, 0], [1, 1, 1, 1]]),
    "mis_sequence": ([[1.6, 0.0, 1.6], [0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], [[1, 1, 1], [0, 0], [1, 1, 1, 1]]),
    "icepop": ([[1.0, 0.0, 0.0], [0.0, 0.0], [1.25, 1.0, 0.8, 1.0]], ALL),
}
CAPPED_METRICS = {  # (weight mean over the tokens kept by both, excluded by either)
    "tis": ((1 + 0.4 + 0.25 + 1.25 + 1 + 0.8 + 1) / 7, 2 / 9),
    "mis_token": ((1 + 1.25 + 1 + 0.8 + 1) / 5, 4 / 9),
    "mis_sequence": ((2 * 1.6 + 4 * 1.0) / 6, 3 / 9),
    "icepop": ((1 + 1.25 + 1 + 0.8 + 1) / 5, 4 / 9),
}


def padded(rows, fill) -> torch.Tensor:
    return torch.tensor([row + [fill] * (WIDTH - len(row)) for row in rows], dtype=F64)


def close(actual, expected, atol=1e-12) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0
    )


MASK = padded(ALL, 0)
PAD = MASK == 0


def cfg_of(kind: str, algorithm: str = "grpo", **fields) -> AlgorithmConfig:
    return AlgorithmConfig(off_policy=OffPolicyConfig(kind=kind), **{**ALGORITHMS[algorithm], **fields})


def loss_and_grad(cfg: AlgorithmConfig, advantages=None, **kwargs):
    """``policy_loss`` of the batch and its gradient with respect to the (leaf) current logprobs."""
    old = padded(OLD, -math.inf)
    log_rho, log_r = torch.log(padded(RHO, 1.0)), torch.log(padded(R, 1.0))
    prox = (old + log_rho).masked_fill(PAD, math.inf)
    logprobs = (old + log_rho + log_r).masked_fill(PAD, math.nan).requires_grad_()
    if advantages is None:
        advantages = torch.tensor(ADVANTAGES, dtype=F64)
    kwargs = {"prox_logprobs": prox, "max_tokens": MAX_TOKENS, **kwargs}
    loss, metrics = policy_loss(logprobs, old, advantages, MASK, cfg, **kwargs)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), grad, metrics


def surrogate(r: float, a: float, clip_low: float, clip_high: float) -> tuple[float, float]:
    """PPO's per-token loss ``-min(r A, clip(r) A)`` and its derivative in the logprob (0 where the clip binds)."""
    unclipped, clipped = -a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high)
    return (clipped, 0.0) if clipped > unclipped else (unclipped, -a * r)


def _expected(weights, loss_mask, cfg: AlgorithmConfig, advantages) -> tuple[float, torch.Tensor]:
    """The loss ``aggregate(weight * surrogate, loss_mask)`` and its gradient, written out per aggregation."""
    counts = [sum(row) for row in loss_mask]
    sequences = sum(1 for n in counts if n)
    loss, grad = 0.0, torch.zeros(len(RHO), WIDTH, dtype=F64)
    for i, row in enumerate(R):
        # the count this sequence's tokens are divided by
        divisor = {
            "token_mean": sum(counts),
            "seq_mean_token_mean": counts[i] * sequences,
            "seq_mean_token_sum_norm": MAX_TOKENS * sequences,
        }[cfg.loss_agg]
        for j, r in enumerate(row):
            if not loss_mask[i][j]:
                continue
            a = advantages[i][j] if isinstance(advantages[i], list) else advantages[i]
            value, slope = surrogate(r, a, cfg.clip_low, cfg.clip_high)
            loss += weights[i][j] * value / divisor
            grad[i, j] = weights[i][j] * slope / divisor
    return loss, grad


def check_padding(grad: torch.Tensor) -> None:
    assert grad.isfinite().all()
    assert (grad[PAD] == 0).all()


# ---------------------------------------------------------------- each correction, each aggregation


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_gradient_match_the_hand_computation(kind, algorithm):
    cfg = cfg_of(kind, algorithm)
    loss, grad, _ = loss_and_grad(cfg)
    weights, loss_mask = EXPECTED[kind]
    want_loss, want_grad = _expected(weights, loss_mask, cfg, ADVANTAGES)
    close(loss, want_loss)
    close(grad, want_grad)
    check_padding(grad)
    # a token the correction weighs 0 (rejected by MIS or IcePop) gets exactly no gradient
    rejected = (padded(weights, 1.0) == 0) & ~PAD
    assert (grad[rejected] == 0).all()
    assert rejected.any() == (kind != "tis")


@pytest.mark.parametrize("kind", KINDS)
def test_metrics_match_the_hand_counts(kind):
    _, _, metrics = loss_and_grad(cfg_of(kind))
    weight_mean, excluded, truncated = METRICS[kind]
    close(metrics["off_policy_weight_mean"], weight_mean)
    # the fractions are counts divided in float32 (long / long), fine for a metric
    close(metrics["off_policy_excluded_frac"], excluded, atol=1e-7)
    close(metrics["off_policy_truncated_frac"], truncated, atol=1e-7)
    # the clip and the ratio are against prox, over every loss token: (1, 1) and (2, 0) are clipped
    close(metrics["clip_frac"], 2 / 9)
    close(metrics["ratio_mean"], sum(map(sum, R)) / 9)
    assert "behavior_weight_mean" not in metrics


def test_mis_token_drops_rejected_tokens_from_the_normaliser_and_icepop_keeps_them():
    # the same weights, so the same numerator: sum of weight * surrogate over the tokens weighted non-zero
    # (0, 0) 1 * -1, (1, 0) 1.5 * 2, (2, 0) 1.25 * -0.6 (clipped at 1.2), (2, 1) -0.5, (2, 2) 0.8 * -0.45, (2, 3) -0.5
    total = -1 + 3 - 0.75 - 0.5 - 0.36 - 0.5
    mis_loss, mis_grad, _ = loss_and_grad(cfg_of("mis_token", "dapo", clip_high=0.2))
    ice_loss, ice_grad, _ = loss_and_grad(cfg_of("icepop", "dapo", clip_high=0.2))
    close(mis_loss, total / 6)  # token_mean over the 6 kept tokens
    close(ice_loss, total / 9)  # over all 9 loss tokens
    close(mis_grad * 6, ice_grad * 9)
    close(ice_grad[0, 0], -1 / 9)
    # seq_mean_token_mean: sequence counts 1, 1, 4 (MIS) against 3, 2, 4 (IcePop), sequence 2's sum -2.11
    mis_loss, mis_grad, _ = loss_and_grad(cfg_of("mis_token", "grpo"))
    ice_loss, ice_grad, _ = loss_and_grad(cfg_of("icepop", "grpo"))
    close(mis_loss, (-1 / 1 + 3 / 1 - 2.11 / 4) / 3)
    close(ice_loss, (-1 / 3 + 3 / 2 - 2.11 / 4) / 3)
    close(mis_grad[1, 0], 1.5 * 2 / 3)
    close(ice_grad[1, 0], 1.5 * 2 / 6)
    # Dr. GRPO divides by a constant and no sequence lost all its tokens: there the two coincide
    mis_loss, mis_grad, _ = loss_and_grad(cfg_of("mis_token", "dr_grpo"))
    ice_loss, ice_grad, _ = loss_and_grad(cfg_of("icepop", "dr_grpo"))
    close(mis_loss, total / (MAX_TOKENS * 3))
    close(ice_loss, mis_loss)
    close(ice_grad, mis_grad)


def test_mis_sequence_drops_a_rejected_sequence_from_the_sequence_count():
    # sequence 1 (ratio 0.375) leaves: GRPO's mean is over the 2 others, not 3
    # sequence 0: 1.6 * (-1 - 1.1 - 0.5) / 3; sequence 2: (-0.6 - 0.5 - 0.45 - 0.5) / 4
    loss, grad, _ = loss_and_grad(cfg_of("mis_sequence", "grpo"))
    close(loss, (1.6 * -2.6 / 3 - 2.05 / 4) / 2)
    assert (grad[1] == 0).all()
    close(grad[0, :3], [1.6 * -1 / 6, 1.6 * -1.1 / 6, 1.6 * -0.5 / 6])


# ---------------------------------------------------------------- PPO's per-token advantages


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
def test_per_token_advantages_match_the_hand_computation(kind, algorithm):
    # per token: (0, 1) A = -1 at r = 1.1 inside the clip range; (1, 1) A = 0.5 at r = 0.7 (unclipped, its
    # gradient flows, unlike with A = -2); (2, 0) r = 1.5 with A = 0.5 is clipped; padding holds 1e6
    cfg = cfg_of(kind, algorithm)
    advantages = padded(TOKEN_ADVANTAGES, 1e6)
    loss, grad, _ = loss_and_grad(cfg, advantages=advantages)
    want_loss, want_grad = _expected(*EXPECTED[kind], cfg, TOKEN_ADVANTAGES)
    close(loss, want_loss)
    close(grad, want_grad)
    check_padding(grad)


def test_per_token_advantages_equal_to_the_sequences_give_the_same_loss():
    cfg = cfg_of("icepop", "grpo")
    per_token = torch.tensor(ADVANTAGES, dtype=F64)[:, None].expand(-1, WIDTH).masked_fill(PAD, math.inf)
    loss, grad, metrics = loss_and_grad(cfg)
    loss_2d, grad_2d, metrics_2d = loss_and_grad(cfg, advantages=per_token)
    close(loss_2d, loss)
    close(grad_2d, grad)
    assert metrics_2d == pytest.approx(metrics)


# ---------------------------------------------------------------- with decoupled PPO's cap


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_behaviour_cap_excludes_inside_the_normaliser_and_the_corrections_weight_scales_the_rest(kind, algorithm):
    cfg = cfg_of(kind, algorithm, behavior_weight_cap=CAP)
    loss, grad, metrics = loss_and_grad(cfg)
    weights, loss_mask = CAPPED[kind]
    want_loss, want_grad = _expected(weights, loss_mask, cfg, ADVANTAGES)
    close(loss, want_loss)
    close(grad, want_grad)
    check_padding(grad)
    assert grad[0, 1] == 0 and grad[1, 0] == 0  # above the cap
    weight_mean, excluded = CAPPED_METRICS[kind]
    close(metrics["off_policy_weight_mean"], weight_mean)
    close(metrics["off_policy_excluded_frac"], excluded, atol=1e-7)
    assert "behavior_weight_mean" not in metrics


def test_the_cap_keeps_an_excluded_token_in_the_normaliser():
    # icepop under token_mean: the cap zeroes (1, 0) (1.5 * 2 = 3 of the uncapped numerator -0.11) and the
    # divisor stays 9; were the token taken out of the normaliser it would be 8
    loss, _, _ = loss_and_grad(cfg_of("icepop", "dapo", clip_high=0.2, behavior_weight_cap=CAP))
    close(loss, (-0.11 - 3) / 9)


def test_a_tis_token_the_cap_excludes_is_not_also_counted_as_truncated():
    # (0, 1): rho 4, truncated to 2 by TIS, then excluded by the cap 1.4: its weight is 0, not the TIS cap
    _, _, metrics = loss_and_grad(cfg_of("tis", behavior_weight_cap=CAP))
    close(metrics["off_policy_excluded_frac"], 2 / 9, atol=1e-7)
    close(metrics["off_policy_truncated_frac"], 0.0, atol=1e-7)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("kind", KINDS)
def test_a_correction_without_prox_logprobs_is_refused_naming_them(kind):
    with pytest.raises(ValueError, match=r"off_policy\.kind need prox_logprobs"):
        loss_and_grad(cfg_of(kind), prox_logprobs=None)
