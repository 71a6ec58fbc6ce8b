"""Advantage estimators, per-token loss terms and aggregation against hand-computed values and invariants."""

import math
import re
from dataclasses import replace

import pytest
import torch

from hpcrl.config import ConfigError
from hpcrl.config.checks import KL_COMBINATIONS, check_kl
from hpcrl.config.schema import AlgorithmConfig, KLConfig
from hpcrl.train.algorithms import (
    AGGREGATIONS,
    aggregate,
    behavior_weights,
    clipped_surrogate,
    compute_advantages,
    equal_reward_groups,
    kl_penalty,
    loss_normalizer,
    policy_loss,
    reward_to_go,
)
from hpcrl.train.algorithms.advantages import batch_norm, group_center, group_norm

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual, expected, atol=1e-9) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0
    )


# ---------------------------------------------------------------- advantages


def test_group_norm_uses_population_std():
    # group [1, 0, 1, 0]: mean 0.5; population std sqrt(4 * 0.25 / 4) = 0.5 -> [1, -1, 1, -1]
    # (the unbiased std sqrt(1 / 3) = 0.577 would give +-0.866)
    # group [2, 4, 4, 4, 5, 5, 7, 9]: mean 5; deviations [-3,-1,-1,-1,0,0,2,4], squares sum 32, 32 / 8 = 4 -> std 2
    close(group_norm(t([[1, 0, 1, 0]]), 0.0), [[1, -1, 1, -1]])
    close(group_norm(t([[2, 4, 4, 4, 5, 5, 7, 9]]), 0.0), [[-1.5, -0.5, -0.5, -0.5, 0, 0, 1, 2]])
    # eps is added to the std: (1 - 0.5) / (0.5 + 0.5) = 0.5
    close(group_norm(t([[1, 0]]), 0.5), [[0.5, -0.5]])


def test_group_center_subtracts_only_the_mean():
    # means 2 and 1
    close(group_center(t([[1, 2, 3], [0, 0, 3]])), [[-1, 0, 1], [-1, -1, 2]])


def test_batch_norm_uses_the_whole_batch():
    # all rewards [0, 2, 4, 6]: mean 3, population variance (9 + 1 + 1 + 9) / 4 = 5
    expected = t([[-3, -1], [1, 3]]) / math.sqrt(5)
    close(batch_norm(t([[0, 2], [4, 6]]), 0.0), expected)
    # per group it would have been [[-1, 1], [-1, 1]]
    close(group_norm(t([[0, 2], [4, 6]]), 0.0), [[-1, 1], [-1, 1]])


@pytest.mark.parametrize("estimator", [group_norm, group_center, batch_norm])
def test_constant_rewards_give_exact_zero_advantages(estimator):
    # 0.1 * 3 / 3 != 0.1 in floating point: without the special case r - mean would be ~1e-17, and / eps ~1e-11
    rewards = t([[0.1, 0.1, 0.1], [0.1, 0.1, 0.1]])
    advantages = estimator(rewards, 1e-6)
    assert not advantages.isnan().any()
    assert (advantages == 0).all()


def test_equal_reward_groups():
    rewards = t([[1, 1, 1], [1, 0, 1], [0, 0, 0], [0.5, 0.5, 0.25]])
    assert equal_reward_groups(rewards).tolist() == [True, False, True, False]
    # constant groups are exactly zero next to non-constant ones
    assert (group_norm(rewards, 1e-6)[[0, 2]] == 0).all()


def test_compute_advantages_dispatches_on_config():
    rewards = t([[1, 0], [3, 3]])
    cfg = AlgorithmConfig(group_size=2, std_eps=1e-6)
    close(compute_advantages(rewards, cfg), group_norm(rewards, 1e-6))
    close(compute_advantages(rewards, replace(cfg, advantage="group_center")), [[0.5, -0.5], [0, 0]])
    close(compute_advantages(rewards, replace(cfg, advantage="batch_norm")), batch_norm(rewards, 1e-6))
    assert compute_advantages(torch.tensor([[1, 0], [0, 0]]), cfg).is_floating_point()


def test_compute_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match=r"algorithm\.advantage"):
        compute_advantages(t([[1, 0]]), AlgorithmConfig(group_size=2, advantage="gae"))
    with pytest.raises(ValueError, match=r"group_size=8"):
        compute_advantages(t([[1, 0]]), AlgorithmConfig(group_size=8))


# ---------------------------------------------------------------- clipped surrogate


def test_clipped_surrogate_hand_example():
    # clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]; ratios 0.5, 1, 1.5; loss = -min(r * A, clip(r) * A)
    # A = +1: -min(0.5, 0.8) = -0.5 | -min(1, 1) = -1 | -min(1.5, 1.28) = -1.28 (clipped)
    # A = -1: -min(-0.5, -0.8) = 0.8 (clipped) | -min(-1, -1) = 1 | -min(-1.5, -1.28) = 1.5
    logprobs = torch.log(t([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]))
    loss, clipped = clipped_surrogate(logprobs, torch.zeros_like(logprobs), t([1, -1]), 0.2, 0.28)
    close(loss, [[-0.5, -1, -1.28], [0.8, 1, 1.5]])
    assert clipped.tolist() == [[False, False, True], [True, False, False]]


def test_at_ratio_one_the_loss_is_the_plain_policy_gradient():
    logprobs = t([[-0.3, -1.2, -2.0]]).requires_grad_()
    advantages = t([[0.7, -1.5, 2.0]])
    loss, clipped = clipped_surrogate(logprobs, logprobs.detach(), advantages, 0.2, 0.2)
    close(loss, -advantages)  # -A * ratio with ratio 1
    assert not clipped.any()
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    close(grad, -advantages)  # d(-A * exp(lp - old)) / d lp = -A * ratio = -A


def test_clip_bounds_zero_the_gradient_on_the_right_side_only():
    clip_low, clip_high = 0.1, 0.3  # asymmetric: [0.9, 1.3]
    ratios = t([0.5, 0.85, 0.95, 1.0, 1.2, 1.35, 2.0])
    logprobs = torch.log(ratios).requires_grad_()
    old = torch.zeros_like(ratios)
    for advantage, frozen in ((1.0, ratios > 1 + clip_high), (-1.0, ratios < 1 - clip_low)):
        loss, clipped = clipped_surrogate(logprobs, old, t([advantage] * 7), clip_low, clip_high)
        (grad,) = torch.autograd.grad(loss.sum(), logprobs)
        assert clipped.tolist() == frozen.tolist()
        close(grad[frozen], torch.zeros(int(frozen.sum())))
        close(grad[~frozen], -advantage * ratios[~frozen])  # gradient of -A * ratio, unclipped
    # asymmetry: 1.2 is inside [0.9, 1.3] (clipped under a symmetric 0.1), 0.85 is outside on the low side
    assert (ratios[4] < 1 + clip_high) and (ratios[1] < 1 - clip_low)


# ---------------------------------------------------------------- KL and behaviour weights


def test_kl_estimators_hand_example():
    # p = 0.5, p_ref = 0.25: k1 = log 2, k2 = (log 2)^2 / 2; k3 with d = log(0.25 / 0.5) = -log 2: exp(d) - d - 1
    logprobs, ref = torch.log(t([0.5])), torch.log(t([0.25]))
    close(kl_penalty(logprobs, ref, "k1"), [math.log(2)])
    close(kl_penalty(logprobs, ref, "k2"), [math.log(2) ** 2 / 2])
    close(kl_penalty(logprobs, ref, "k3"), [math.log(2) - 0.5])
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logprobs, ref, "k4")


def test_k3_is_never_negative():
    grid = torch.linspace(-8, 8, 161, dtype=F64)
    logprobs, ref = torch.meshgrid(grid, grid, indexing="ij")
    assert (kl_penalty(logprobs, ref, "k3") >= 0).all()


def test_k1_and_k3_means_estimate_the_kl():
    p, ref = t([0.5, 0.3, 0.2]), t([0.2, 0.5, 0.3])
    exact = (p * (p / ref).log()).sum()  # KL(p || ref) = 0.2271
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    for name in ("k1", "k3"):
        estimate = kl_penalty(p.log()[tokens], ref.log()[tokens], name).mean()
        close(estimate, exact, atol=5e-3)


def test_reward_to_go_sums_each_token_and_those_after_it():
    close(reward_to_go(t([[1, 2, 3], [0, 5, 0]])), [[6, 5, 3], [5, 5, 0]])


# ---------------------------------------------------------------- the KL term's expected gradient, enumerated
#
# A policy over a vocabulary of V tokens, softmax(theta), and a fixed reference. The expected gradient of the
# loss over samples y ~ pi is sum_y pi(y) * grad loss(y): pi(y) is a constant there (the sampler is not
# differentiated), exactly as in training. Every allowed (place, estimator) must give kl.coef times autograd's
# gradient of the true KL(pi || ref); the task's advantage is 0, so the KL term is all that is left.

V, COEF = 5, 0.3


def _policy(seed: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(*shape, V, generator=g, dtype=F64).requires_grad_()
    ref = torch.log_softmax(torch.randn(*shape, V, generator=g, dtype=F64) * 1.5, dim=-1)
    return theta, ref


def _kl_cfg(place: str, estimator: str) -> AlgorithmConfig:
    return AlgorithmConfig(loss_agg="token_mean", kl=KLConfig(coef=COEF, place=place, estimator=estimator))


def _token_loss(cfg: AlgorithmConfig, logprobs: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """policy_loss of one sequence of sampled tokens (on-policy: the behaviour logprobs are these), summed over
    its tokens (a normaliser of 1)."""
    lp = logprobs.reshape(1, -1)
    loss, _ = policy_loss(
        lp, lp.detach(), t([0.0]), torch.ones_like(lp), cfg, ref_logprobs=ref.reshape(1, -1), global_normalizer=1
    )
    return loss


@pytest.mark.parametrize(("place", "estimator"), sorted(KL_COMBINATIONS.items()))
def test_each_allowed_kl_term_has_the_gradient_of_the_true_kl_on_one_token(place, estimator):
    theta, ref = _policy(0)
    logp = torch.log_softmax(theta, dim=-1)
    pi = logp.exp().detach()
    expected = sum(pi[y] * _token_loss(_kl_cfg(place, estimator), logp[y], ref[y]) for y in range(V))
    (got,) = torch.autograd.grad(expected, theta, retain_graph=True)
    (true,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    assert true.abs().max() > 0.05, "a KL whose gradient is near 0 would prove nothing"
    close(got, COEF * true, atol=1e-6)


def _two_token_sequences(seed: int):
    """Every sequence (y1, y2) of a two-step policy pi(y1) pi(y2 | y1), its probability and its logprobs."""
    (theta1, ref1), (theta2, ref2) = _policy(seed), _policy(seed + 1, V)
    lp1, lp2 = torch.log_softmax(theta1, -1), torch.log_softmax(theta2, -1)
    seqs = [(a, b) for a in range(V) for b in range(V)]
    prob = {s: (lp1[s[0]] + lp2[s[0], s[1]]).exp().detach() for s in seqs}
    logprobs = {s: torch.stack([lp1[s[0]], lp2[s[0], s[1]]]) for s in seqs}
    refs = {s: torch.stack([ref1[s[0]], ref2[s[0], s[1]]]) for s in seqs}
    seq_kl = sum((lp1[a] + lp2[a, b]).exp() * (lp1[a] + lp2[a, b] - ref1[a] - ref2[a, b]) for a, b in seqs)
    # each token's KL at the prefix sampled, the prefix's probability held constant
    token_kls = (lp1.exp() * (lp1 - ref1)).sum() + sum(
        lp1[a].exp().detach() * (lp2[a].exp() * (lp2[a] - ref2[a])).sum() for a in range(V)
    )
    return (theta1, theta2), seqs, prob, logprobs, refs, seq_kl, token_kls


def _expected_grad(cfg, thetas, seqs, prob, logprobs, refs):
    expected = sum(prob[s] * _token_loss(cfg, logprobs[s], refs[s]) for s in seqs)
    return torch.cat([g.flatten() for g in torch.autograd.grad(expected, thetas, retain_graph=True)])


def _grad(value, thetas):
    return torch.cat([g.flatten() for g in torch.autograd.grad(value, thetas, retain_graph=True)])


def test_kl_in_the_reward_has_the_gradient_of_the_sequences_kl():
    thetas, seqs, prob, logprobs, refs, seq_kl, _ = _two_token_sequences(10)
    got = _expected_grad(_kl_cfg("reward", "k1"), thetas, seqs, prob, logprobs, refs)
    close(got, COEF * _grad(seq_kl, thetas), atol=1e-6)


def test_kl_in_the_loss_has_the_gradient_of_each_tokens_kl_at_its_prefix():
    # the per-token loss term misses how the first token changes the second's KL (Tang & Munos 2025, section 4):
    # its expected gradient is that of each token's KL with the prefix distribution held, not the sequence's
    thetas, seqs, prob, logprobs, refs, seq_kl, token_kls = _two_token_sequences(20)
    got = _expected_grad(_kl_cfg("loss", "k2"), thetas, seqs, prob, logprobs, refs)
    close(got, COEF * _grad(token_kls, thetas), atol=1e-6)
    assert not torch.allclose(got, COEF * _grad(seq_kl, thetas), atol=1e-3), "the two targets differ here"


@pytest.mark.parametrize(
    ("place", "estimator", "why"),
    [
        ("loss", "k1", "expected gradient of exactly 0"),
        ("loss", "k3", "the expected gradient of KL(ref || pi), the other direction"),
        ("reward", "k2", "only k1 makes the policy gradient"),
        ("reward", "k3", "only k1 makes the policy gradient"),
    ],
)
def test_a_kl_term_without_the_kls_gradient_is_refused_saying_why(place, estimator, why):
    cfg = _kl_cfg(place, estimator)
    with pytest.raises(ConfigError, match=rf"algorithm\.kl\.estimator='{estimator}' is invalid: .*{re.escape(why)}"):
        check_kl(cfg)
    lp = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError, match=re.escape(why)):
        policy_loss(lp, lp, t([1.0]), torch.ones_like(lp), cfg, ref_logprobs=lp)


@pytest.mark.parametrize(
    ("estimator", "target"),
    [("k1", lambda logp, ref: 0.0 * logp.sum()), ("k3", lambda logp, ref: (ref.exp() * (ref - logp)).sum())],
)
def test_the_refused_loss_terms_have_the_gradient_the_refusal_names(estimator, target):
    # what the refusal says, computed: k1 as a loss term moves nothing, k3 follows KL(ref || pi)
    theta, ref = _policy(30)
    logp = torch.log_softmax(theta, dim=-1)
    pi = logp.exp().detach()
    expected = sum(pi[y] * kl_penalty(logp[y], ref[y], estimator) for y in range(V))
    (got,) = torch.autograd.grad(expected, theta, retain_graph=True)
    (want,) = torch.autograd.grad(target(logp, ref), theta, retain_graph=True, materialize_grads=True)
    close(got, want, atol=1e-9)
    (true,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    assert not torch.allclose(got, true, atol=1e-3)


def test_the_old_kl_keys_are_refused_naming_the_new_ones():
    with pytest.raises(ConfigError, match=r"algorithm\.kl_coef=0\.02 is invalid: .*set algorithm\.kl\.coef instead"):
        check_kl(AlgorithmConfig(kl_coef=0.02))
    with pytest.raises(ConfigError, match=r"algorithm\.kl_estimator='k1' .*set algorithm\.kl\.estimator instead"):
        check_kl(AlgorithmConfig(kl_estimator="k1"))


def test_behavior_weights_exclude_tokens_above_the_cap():
    # weights exp(prox - behaviour) = 0.5, 2, 5, 6 with cap 5: 6 is excluded (weight 0), 5 is kept
    behavior = torch.zeros(4, dtype=F64)
    weight, kept = behavior_weights(torch.log(t([0.5, 2.0, 5.0, 6.0])), behavior, 5.0)
    close(weight, [0.5, 2.0, 5.0, 0.0])
    assert kept.tolist() == [True, True, True, False]


# ---------------------------------------------------------------- aggregation


PER_TOKEN = t([[1, 2, 3, 4], [5, 6, 9, 9], [7, 7, 7, 7]])  # the 9s and 7s are masked out
MASK = t([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])  # the third sequence has no loss token


def test_aggregate_hand_example():
    # token_mean: (1 + 2 + 3 + 4 + 5 + 6) / 6 tokens = 3.5
    # seq_mean_token_mean: sequence means 10 / 4 = 2.5 and 11 / 2 = 5.5; the empty one is not counted -> 4.0
    # seq_mean_token_sum_norm, max_tokens 4: 10 / 4 = 2.5 and 11 / 4 = 2.75 -> 2.625
    close(aggregate(PER_TOKEN, MASK, "token_mean"), 3.5)
    close(aggregate(PER_TOKEN, MASK, "seq_mean_token_mean"), 4.0)
    close(aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", max_tokens=4), 2.625)
    assert loss_normalizer(MASK, "token_mean") == 6
    assert loss_normalizer(MASK, "seq_mean_token_mean") == 2


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_of_nothing_is_zero(mode):
    loss = aggregate(PER_TOKEN, torch.zeros_like(MASK), mode, max_tokens=4)
    assert loss.item() == 0.0


def test_aggregate_rejects_bad_mode_and_missing_max_tokens():
    with pytest.raises(ValueError, match="sum_mean"):
        aggregate(PER_TOKEN, MASK, "sum_mean")
    with pytest.raises(ValueError, match="max_new_tokens"):
        aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm")


# ---------------------------------------------------------------- policy_loss


def _batch(seed: int, batch: int = 6, seq: int = 5) -> dict[str, torch.Tensor]:
    """Random logprobs near an old policy, one empty sequence, varying lengths."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq, generator=g, dtype=F64) * 3
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[2] = 0
    return {
        "logprobs": old + torch.randn(batch, seq, generator=g, dtype=F64) * 0.3,
        "old_logprobs": old,
        "advantages": torch.randn(batch, generator=g, dtype=F64),
        "mask": (torch.arange(seq)[None, :] < lengths[:, None]).to(F64),
        "ref_logprobs": old + torch.randn(batch, seq, generator=g, dtype=F64) * 0.2,
        "prox_logprobs": old + torch.randn(batch, seq, generator=g, dtype=F64) * 0.8,
    }


FULL = AlgorithmConfig(kl=KLConfig(coef=0.1), behavior_weight_cap=2.0)  # every term on


def _loss_and_grad(batch, cfg, **kwargs):
    logprobs = batch["logprobs"].clone().requires_grad_()
    args = {k: v for k, v in batch.items() if k not in ("logprobs", "old_logprobs", "advantages", "mask")}
    loss, metrics = policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], batch["mask"], cfg, max_tokens=5, **args, **kwargs
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), grad, metrics


def test_policy_loss_hand_example_with_decoupled_weight_and_kl_in_the_reward():
    # token_mean over 3 tokens, A = 1, clip [0.8, 1.2], cap 3, kl.coef 0.5 in the reward with k1 = behaviour - ref
    # k1 = 0 - log [1, 2, 4]; summed from each token to the end: -log 8, -log 8, -log 4
    # advantage per token = 1 - 0.5 * that: 1 + 0.5 log 8, 1 + 0.5 log 8, 1 + 0.5 log 4
    # token   ratio vs prox   behaviour weight   surrogate
    #   0     1.0             exp(0) = 1         -1.0 * A0 * 1
    #   1     1.5 -> clip 1.2 exp(log 2) = 2     -1.2 * A1 * 2 (A1 > 0: the clip binds)
    #   2     1.0             exp(log 4) = 4 > 3 excluded: 0
    behavior = t([[0.0, 0.0, 0.0]])
    prox = torch.log(t([[1.0, 2.0, 4.0]]))
    logprobs = prox + torch.log(t([[1.0, 1.5, 1.0]]))
    cfg = AlgorithmConfig(
        loss_agg="token_mean", kl=KLConfig(coef=0.5, place="reward", estimator="k1"), behavior_weight_cap=3.0
    )
    loss, metrics = policy_loss(
        logprobs, behavior, t([1.0]), torch.ones(1, 3), cfg, ref_logprobs=prox, prox_logprobs=prox
    )
    a = 1 + 0.5 * math.log(8)
    close(loss, (-a - 2.4 * a) / 3)
    close(metrics["clip_frac"], 1 / 3)
    close(metrics["behavior_weight_mean"], 1.5)  # mean over the kept tokens: (1 + 2) / 2
    close(metrics["behavior_excluded_frac"], 1 / 3)
    # the metric is k3 of the current policy: token 1 has d = log(2 / 3), k3 = 2/3 - log(2/3) - 1
    close(metrics["kl"], (math.log(1.5) - 1 / 3) / 3)


def test_kl_in_the_loss_adds_coef_times_k2_per_token():
    # one token, A = 0, ratio 1: the loss is the KL term alone, 0.5 * (log 3 - log 2)^2 / 2
    logprobs, ref = torch.log(t([[3.0]])), torch.log(t([[2.0]]))
    cfg = AlgorithmConfig(loss_agg="token_mean", kl=KLConfig(coef=0.5, place="loss", estimator="k2"))
    loss, _ = policy_loss(logprobs, logprobs, t([0.0]), torch.ones(1, 1), cfg, ref_logprobs=ref)
    close(loss, 0.5 * math.log(1.5) ** 2 / 2)


def test_behavior_cap_off_ignores_prox_and_uses_old_logprobs():
    batch = _batch(0)
    plain = replace(FULL, behavior_weight_cap=0.0)
    loss, grad, metrics = _loss_and_grad(batch, plain)
    loss_no_prox, grad_no_prox, _ = _loss_and_grad({**batch, "prox_logprobs": None}, plain)
    close(loss, loss_no_prox)
    close(grad, grad_no_prox)
    assert "behavior_weight_mean" not in metrics
    # with the cap on and prox == old, every weight is 1 and the loss is the plain one
    loss_same, grad_same, metrics_same = _loss_and_grad({**batch, "prox_logprobs": batch["old_logprobs"]}, FULL)
    close(loss_same, loss)
    close(grad_same, grad)
    close(metrics_same["behavior_excluded_frac"], 0.0)


def test_excluded_tokens_get_no_gradient_but_stay_in_the_normaliser():
    batch = _batch(1)
    cfg = replace(FULL, kl=KLConfig(), loss_agg="token_mean")
    weight, kept = behavior_weights(batch["prox_logprobs"], batch["old_logprobs"], cfg.behavior_weight_cap)
    excluded = ~kept & (batch["mask"] != 0)
    assert excluded.any() and (kept & (batch["mask"] != 0)).any()
    loss, grad, _ = _loss_and_grad(batch, cfg)
    assert (grad[excluded] == 0).all()
    # same loss as dropping those tokens from the numerator only, dividing by every masked token
    per_token, _ = clipped_surrogate(batch["logprobs"], batch["prox_logprobs"], batch["advantages"], 0.2, 0.2)
    expected = (per_token * weight * batch["mask"]).sum() / batch["mask"].sum()
    close(loss, expected)


def test_decoupled_needs_prox_and_kl_needs_ref():
    batch = _batch(2)
    with pytest.raises(ValueError, match="prox_logprobs"):
        _loss_and_grad({**batch, "prox_logprobs": None}, FULL)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _loss_and_grad({**batch, "ref_logprobs": None}, FULL)


def test_policy_loss_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"algorithm\.loss_agg.*sum"):
        _loss_and_grad(_batch(3), replace(FULL, loss_agg="sum"))
    with pytest.raises(ValueError, match=r"algorithm\.kl\.estimator.*k4"):
        _loss_and_grad(_batch(3), replace(FULL, kl=KLConfig(coef=0.1, estimator="k4")))


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_zero_advantages_give_zero_policy_gradient(mode):
    batch = {**_batch(4), "advantages": torch.zeros(6, dtype=F64)}
    _, grad, _ = _loss_and_grad(batch, replace(FULL, kl=KLConfig(), loss_agg=mode))
    assert (grad == 0).all()


def test_per_sequence_advantages_broadcast_over_tokens():
    batch = _batch(5)
    per_token = batch["advantages"][:, None].expand(-1, 5)
    loss, grad, _ = _loss_and_grad(batch, FULL)
    loss_2d, grad_2d, _ = _loss_and_grad({**batch, "advantages": per_token}, FULL)
    close(loss, loss_2d)
    close(grad, grad_2d)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_masked_out_tokens_change_nothing(mode):
    batch = _batch(6)
    cfg = replace(FULL, loss_agg=mode)
    loss, grad, metrics = _loss_and_grad(batch, cfg)
    off = batch["mask"] == 0
    junk = {}
    for key, value in (("logprobs", -math.inf), ("old_logprobs", 50.0), ("ref_logprobs", math.nan)):
        junk[key] = batch[key].masked_fill(off, value)
    junk["prox_logprobs"] = batch["prox_logprobs"].masked_fill(off, -50.0)
    junk["advantages"] = batch["advantages"][:, None].expand(-1, 5).masked_fill(off, 1e6)
    loss_junk, grad_junk, metrics_junk = _loss_and_grad({**batch, **junk}, cfg)
    close(loss_junk, loss)
    close(grad_junk, grad)
    assert (grad_junk[off] == 0).all()
    assert metrics_junk == pytest.approx(metrics)


# ---------------------------------------------------------------- micro-batches and ranks


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batch_losses_with_a_global_normaliser_sum_to_the_full_batch(mode):
    batch = _batch(7, batch=8, seq=6)
    cfg = replace(FULL, loss_agg=mode)
    full_loss, full_grad, _ = _loss_and_grad(batch, cfg)
    # micro-batches of uneven size, each cut to its own padded width (what a token-budget packer produces);
    # think of the first two as rank 0's micro-batches and the last as rank 1's
    pieces = [slice(0, 3), slice(3, 4), slice(4, 8)]
    widths = [int(batch["mask"][s].sum(-1).max().clamp(min=1)) for s in pieces]
    micro = [
        {k: v[s] if v.dim() == 1 else v[s, :w] for k, v in batch.items()} for s, w in zip(pieces, widths, strict=True)
    ]
    global_normalizer = sum(loss_normalizer(m["mask"], mode) for m in micro)  # sum, then all_reduce on ranks
    total_loss, total_grad = 0.0, torch.zeros_like(full_grad)
    for s, w, m in zip(pieces, widths, micro, strict=True):
        loss, grad, _ = _loss_and_grad(m, cfg, global_normalizer=global_normalizer)
        total_loss += loss
        total_grad[s, :w] += grad
    close(total_loss, full_loss)
    close(total_grad, full_grad)
    # without the global normaliser the pieces' sum is not the full loss
    unnormalised = sum(_loss_and_grad(m, cfg)[0] for m in micro)
    assert not torch.isclose(unnormalised, full_loss)
