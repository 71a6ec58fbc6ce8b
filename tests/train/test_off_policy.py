"""Mismatch metrics and off-policy corrections (TIS, MIS per token and per sequence, IcePop) against hand values."""

import math

import pytest
import torch

from hpcrl.train.algorithms import aggregate, behavior_weights
from hpcrl.train.algorithms.off_policy import icepop, mis_sequence, mis_token, mismatch_metrics, tis

F64 = torch.float64
NAN, INF = math.nan, math.inf


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual, expected, atol=1e-12) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0
    )


def log_of(ratios) -> torch.Tensor:
    """Trainer logprobs whose ratios to a behaviour policy at logprob 0 are ``ratios`` (NaN stays NaN)."""
    return torch.log(t(ratios))


def loss_and_grad(correction, trainer, advantages, mask, mode="token_mean", current=None):
    """The per-token loss ``-weight * A * exp(logprobs - trainer)`` reduced by ``aggregate`` over the correction's
    loss mask, at ``logprobs = trainer + log(current)`` (current ratio 1 unless given), and its gradient.
    Padding is zeroed before the loss, as ``policy_loss`` does: a NaN there would poison the gradient."""
    off = mask == 0
    anchor = trainer.masked_fill(off, 0.0)
    shift = torch.zeros_like(anchor) if current is None else torch.log(current).masked_fill(off, 0.0)
    logprobs = (anchor + shift).requires_grad_()
    per_token = -correction.weight * advantages[:, None] * torch.exp(logprobs - anchor)
    loss = aggregate(per_token, correction.loss_mask, mode)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), grad


# ---------------------------------------------------------------- mismatch metrics

# behaviour logprob 0, so the trainer's is the log ratio d; row 2 has no loss token; the padding holds junk
MASK = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
TRAINER = log_of([[1.0, 2.0, 0.25], [1.5, 1.0, NAN], [INF, NAN, 0.0]])
BEHAVIOUR = t([[0.0, 0.0, 0.0], [0.0, 0.0, INF], [-INF, NAN, 5.0]])


def test_mismatch_metrics_hand_example():
    # loss-token ratios 1, 2, 1/4 | 1.5, 1: d = 0, ln 2, -ln 4 | ln 1.5, 0
    # |d| mean (ln 2 + ln 4 + ln 1.5) / 5, max ln 4
    # k3 = rho - 1 - d: 0, 1 - ln 2, ln 4 - 3/4 | 1/2 - ln 1.5, 0 -> (3/4 + ln 2 - ln 1.5) / 5
    # out of [1/2, 2]: only 1/4 (2 is on the edge, inside) -> 1/5 of the tokens, 1/2 of the two sequences
    # sequence log ratios: 0 + ln 2 - ln 4 = -ln 2 and ln 1.5 -> mean ln(0.75) / 2
    metrics = mismatch_metrics(TRAINER, BEHAVIOUR, MASK)
    assert list(metrics) == [
        "mismatch_abs_mean",
        "mismatch_abs_max",
        "mismatch_kl_k3",
        "mismatch_out_frac",
        "mismatch_seq_out_frac",
        "mismatch_seq_log_ratio",
    ]
    close(metrics["mismatch_abs_mean"], (math.log(2) + math.log(4) + math.log(1.5)) / 5)
    close(metrics["mismatch_abs_max"], math.log(4))
    close(metrics["mismatch_kl_k3"], (0.75 + math.log(2) - math.log(1.5)) / 5)
    close(metrics["mismatch_out_frac"], 1 / 5)
    close(metrics["mismatch_seq_out_frac"], 1 / 2)
    close(metrics["mismatch_seq_log_ratio"], math.log(0.75) / 2)


def test_mismatch_metrics_ignore_the_padding():
    clean = mismatch_metrics(TRAINER.nan_to_num(0.0, 0.0, 0.0), BEHAVIOUR.nan_to_num(0.0, 0.0, 0.0), MASK)
    assert mismatch_metrics(TRAINER, BEHAVIOUR, MASK) == pytest.approx(clean, abs=1e-15)
    # a huge padding gap would otherwise be the max, and count as out of band
    loud = mismatch_metrics(TRAINER.masked_fill(MASK == 0, 1e6), BEHAVIOUR, MASK)
    assert loud == pytest.approx(clean, abs=1e-15)
    assert all(math.isfinite(v) for v in clean.values())


def test_mismatch_metrics_of_an_empty_mask_are_zero():
    assert set(mismatch_metrics(TRAINER, BEHAVIOUR, torch.zeros_like(MASK)).values()) == {0.0}


def test_mismatch_kl_k3_estimates_kl_of_behaviour_to_trainer():
    behaviour, trainer = t([0.5, 0.3, 0.2]), t([0.2, 0.5, 0.3])
    tokens = torch.multinomial(behaviour, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    b, tr = behaviour.log()[tokens][None], trainer.log()[tokens][None]
    estimate = mismatch_metrics(tr, b, torch.ones_like(b))["mismatch_kl_k3"]
    forward = (behaviour * (behaviour / trainer).log()).sum()  # KL(behaviour || trainer) = 0.2271
    reverse = (trainer * (trainer / behaviour).log()).sum()  # the other direction = 0.2393
    close(estimate, forward, atol=3e-3)
    assert abs(estimate - reverse) > 8e-3


def test_mismatch_metrics_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"one shape \[batch, seq\].*\(2, 3\)"):
        mismatch_metrics(TRAINER, BEHAVIOUR, MASK[:2])


# ---------------------------------------------------------------- TIS

TOKEN_MASK = t([[1, 1, 1], [1, 1, 0]])
BEHAVIOUR_0 = t([[0.0, 0.0, 0.0], [0.0, 0.0, NAN]])


def test_tis_hand_example():
    # ratios 0.5, 1, 3 | 2, 1.5 (pad NaN), cap 2: weights 0.5, 1, 2 (3 truncated) | 2 (on the cap: kept), 1.5, 0
    trainer = log_of([[0.5, 1.0, 3.0], [2.0, 1.5, NAN]])
    c = tis(trainer, BEHAVIOUR_0, TOKEN_MASK, cap=2.0)
    close(c.weight, [[0.5, 1, 2], [2, 1.5, 0]])
    assert c.kept.tolist() == c.loss_mask.tolist() == [[True, True, True], [True, True, False]]
    assert (c.excluded.item(), c.truncated.item()) == (0, 1)
    # A = 1, -2; current ratios 1 except 1.2 on token (0, 1); token_mean over 5 tokens
    # loss = (-0.5 - 1.2 - 2 + 4 + 3) / 5 = 0.66; d/dlogprob of -w A r / 5 = -w A r / 5
    current = t([[1.0, 1.2, 1.0], [1.0, 1.0, 1.0]])
    loss, grad = loss_and_grad(c, trainer, t([1.0, -2.0]), TOKEN_MASK, current=current)
    close(loss, 0.66)
    close(grad, [[-0.1, -0.24, -0.4], [0.8, 0.6, 0]])
    assert grad[1, 2].item() == 0.0


def test_tis_rejects_a_cap_not_above_zero():
    for cap in (0.0, -1.0, NAN):
        with pytest.raises(ValueError, match=r"tis: cap must be > 0"):
            tis(BEHAVIOUR_0, BEHAVIOUR_0, TOKEN_MASK, cap)


# ---------------------------------------------------------------- MIS, token level


def test_mis_token_hand_example():
    # band [0.5, 2]; ratios 0.4, 1, 2 | 2.5, 0.5 (pad NaN): kept F, T, T (2 on the edge) | F, T (0.5 on the edge)
    # weights are the kept tokens' ratios: 0, 1, 2 | 0, 0.5; the two rejected ones leave the normaliser: 3 tokens
    trainer = log_of([[0.4, 1.0, 2.0], [2.5, 0.5, NAN]])
    c = mis_token(trainer, BEHAVIOUR_0, TOKEN_MASK, low=0.5, high=2.0)
    close(c.weight, [[0, 1, 2], [0, 0.5, 0]])
    assert c.kept.tolist() == c.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    assert (c.excluded.item(), c.truncated.item()) == (2, 0)
    # A = 1, -2: per token 0, -1, -2 | 0, 1 -> token_mean -2 / 3; gradient -w A / 3
    loss, grad = loss_and_grad(c, trainer, t([1.0, -2.0]), TOKEN_MASK)
    close(loss, -2 / 3)
    close(grad, [[0, -1 / 3, -2 / 3], [0, 1 / 3, 0]])
    excluded = TOKEN_MASK.bool() & ~c.kept
    assert (grad[excluded] == 0).all() and int(excluded.sum()) == c.excluded.item()
    # per sequence (GRPO): (-1 - 2) / 2 = -1.5 and 1 / 1 -> -0.25
    loss, grad = loss_and_grad(c, trainer, t([1.0, -2.0]), TOKEN_MASK, mode="seq_mean_token_mean")
    close(loss, -0.25)
    close(grad, [[0, -0.25, -0.5], [0, 0.5, 0]])


# ---------------------------------------------------------------- MIS, sequence level


def test_mis_sequence_hand_example():
    # band [0.5, 2]; sequence ratio = product of its loss tokens' ratios
    #   seq 0: 2 * 0.8 = 1.6 (pad ignored)    -> kept, weight 1.6 on both tokens
    #   seq 1: 3 * 0.9 * 1 = 2.7              -> rejected whole, though 0.9 and 1 are in the band
    #   seq 2: 0.25 * 4 * 1 = 1               -> kept whole, though 0.25 and 4 are out of the band
    # (the geometric mean of seq 1, 2.7^(1/3) = 1.39, would have kept it: verl's other level, not this one)
    trainer = log_of([[2.0, 0.8, INF], [3.0, 0.9, 1.0], [0.25, 4.0, 1.0]])
    behaviour = t([[0.0, 0.0, -INF], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    c = mis_sequence(trainer, behaviour, mask, low=0.5, high=2.0)
    close(c.weight, [[1.6, 1.6, 0], [0, 0, 0], [1, 1, 1]])
    assert c.kept.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    assert c.loss_mask.tolist() == c.kept.tolist()
    assert c.excluded.item() == 3
    # A = 1, 1, -1, per sequence (GRPO) over the 2 kept sequences: mean(-1.6, -1.6) = -1.6 and mean(1, 1, 1) = 1
    # -> -0.3; gradient -w A / (tokens of the sequence * 2 sequences): -0.4 each | 0 | 1/6 each
    loss, grad = loss_and_grad(c, trainer, t([1.0, 1.0, -1.0]), mask, mode="seq_mean_token_mean")
    close(loss, -0.3)
    close(grad, [[-0.4, -0.4, 0], [0, 0, 0], [1 / 6, 1 / 6, 1 / 6]])
    assert (grad[1] == 0).all()
    # token_mean over the 5 kept tokens: (-3.2 + 3) / 5
    loss, _ = loss_and_grad(c, trainer, t([1.0, 1.0, -1.0]), mask)
    close(loss, -0.04)


# ---------------------------------------------------------------- IcePop


def test_icepop_hand_example():
    # band [0.5, 5]; ratios 0.4, 1, 3 | 6, 0.5 (pad NaN): M(rho) = 0, 1, 3 | 0, 0.5
    trainer = log_of([[0.4, 1.0, 3.0], [6.0, 0.5, NAN]])
    c = icepop(trainer, BEHAVIOUR_0, TOKEN_MASK, alpha=0.5, beta=5.0)
    close(c.weight, [[0, 1, 3], [0, 0.5, 0]])
    assert c.kept.tolist() == [[False, True, True], [False, True, False]]
    assert c.loss_mask.tolist() == TOKEN_MASK.bool().tolist()  # the masked tokens stay in the normaliser
    assert c.excluded.item() == 2
    # A = 1, -2: per token 0, -1, -3 | 0, 1 -> token_mean over all 5 tokens: -3 / 5; gradient -w A / 5
    loss, grad = loss_and_grad(c, trainer, t([1.0, -2.0]), TOKEN_MASK)
    close(loss, -0.6)
    close(grad, [[0, -0.2, -0.6], [0, 0.2, 0]])
    # MIS with the same band weights the same tokens the same but averages over the 3 kept ones only
    loss_mis, _ = loss_and_grad(
        mis_token(trainer, BEHAVIOUR_0, TOKEN_MASK, 0.5, 5.0), trainer, t([1.0, -2.0]), TOKEN_MASK
    )
    close(loss_mis, -1.0)


def test_decoupled_ppos_behaviour_weight_is_icepop_without_a_lower_bound():
    g = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(4, 6, generator=g, dtype=F64) * 3
    prox = behaviour + torch.randn(4, 6, generator=g, dtype=F64) * 0.8
    mask = (torch.rand(4, 6, generator=g) < 0.8).to(F64)
    weight, kept = behavior_weights(prox, behaviour, 2.0)
    c = icepop(prox, behaviour, mask, alpha=0.0, beta=2.0)
    on = mask.bool()
    assert (~kept & on).any() and (kept & on).any()
    close(c.weight[on], weight[on])
    assert c.kept.tolist() == (kept & on).tolist()


# ---------------------------------------------------------------- shared properties


CORRECTIONS = {
    "tis": lambda tr, b, m: tis(tr, b, m, 2.0),
    "mis_token": lambda tr, b, m: mis_token(tr, b, m, 0.5, 2.0),
    "mis_sequence": lambda tr, b, m: mis_sequence(tr, b, m, 0.5, 2.0),
    "icepop": lambda tr, b, m: icepop(tr, b, m, 0.5, 2.0),
}


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_padding_junk_changes_no_weight(name):
    trainer = log_of([[1.5, 0.6, 1.0], [3.0, 1.0, 1.0]])
    junk_trainer, junk_behaviour = trainer.clone(), torch.zeros_like(trainer)
    junk_trainer[1, 2], junk_behaviour[1, 2] = INF, INF  # inf - inf = NaN
    clean = CORRECTIONS[name](trainer, torch.zeros_like(trainer), TOKEN_MASK)
    junk = CORRECTIONS[name](junk_trainer, junk_behaviour, TOKEN_MASK)
    close(junk.weight, clean.weight)
    assert junk.weight[1, 2].item() == 0.0 and not junk.kept[1, 2]
    assert junk.loss_mask.tolist() == clean.loss_mask.tolist()
    assert (junk.excluded.item(), junk.truncated.item()) == (clean.excluded.item(), clean.truncated.item())


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_weights_are_detached_and_at_least_float32(name):
    trainer = torch.zeros(1, 2, requires_grad=True, dtype=torch.bfloat16)
    c = CORRECTIONS[name](trainer, torch.zeros(1, 2), torch.ones(1, 2))
    assert not c.weight.requires_grad and c.weight.dtype == torch.float32
    close(c.weight, [[1.0, 1.0]])


@pytest.mark.parametrize("fn", [mis_token, mis_sequence, icepop])
@pytest.mark.parametrize(("low", "high"), [(2.0, 0.5), (1.0, 1.0), (-0.1, 2.0), (1.5, 2.0), (0.5, 0.9), (NAN, 2.0)])
def test_bad_bands_are_refused_naming_the_arguments(fn, low, high):
    names = ("alpha", "beta") if fn is icepop else ("low", "high")
    with pytest.raises(ValueError, match=rf"{fn.__name__}: the band needs 0 <= {names[0]} <= 1 <= {names[1]}"):
        fn(BEHAVIOUR_0, BEHAVIOUR_0, TOKEN_MASK, low, high)
