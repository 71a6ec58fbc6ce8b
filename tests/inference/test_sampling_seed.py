"""SGLang's ``sampling_seed`` on hpcrl's CPU server: the same seed and logits give the same tokens, whatever else
shares the batch, and seeded draws follow the distribution they are drawn from."""

import pytest
import torch

from hpcrl.inference.server.sampling import BatchSampler, RequestError, SamplingParams, seeded_uniforms

VOCAB = 7


def sampler(*params: SamplingParams) -> BatchSampler:
    return BatchSampler.of(list(params), VOCAB)


def draws(batch: BatchSampler, logits: torch.Tensor, steps: int, generator_seed: int) -> list[list[int]]:
    """``steps`` tokens of every row, one ``sample`` call per step, as a decode loop makes them."""
    generator = torch.Generator().manual_seed(generator_seed)
    tokens = [batch.sample(logits, generator)[0].tolist() for _ in range(steps)]
    return [list(row) for row in zip(*tokens, strict=True)]


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, sampling_seed=1234)
    alone = draws(sampler(seeded), logits, steps=12, generator_seed=0)[0]
    # in a batch with unseeded rows and another seed, at another row, with the server's generator elsewhere
    others = [SamplingParams(), SamplingParams(sampling_seed=99), SamplingParams(temperature=0)]
    batch = draws(sampler(others[0], seeded, *others[1:]), logits.expand(4, -1), steps=12, generator_seed=7)
    assert batch[1] == alone
    assert batch[2] != alone, "another seed draws other tokens"
    assert len(set(alone)) > 1, "the token t-th drawn has noise of its own"
    # rows that join or leave the batch keep their own count of tokens drawn
    first, rest = sampler(seeded), sampler(others[0])
    generator = torch.Generator()
    head = [first.sample(logits, generator)[0].item() for _ in range(5)]
    joined = first.cat(rest)
    tail = [joined.sample(logits.expand(2, -1), generator)[0][0].item() for _ in range(4)]
    kept = joined.select(torch.tensor([0]))
    tail += [kept.sample(logits, generator)[0].item() for _ in range(3)]
    assert head + tail == alone


def test_seeded_draws_follow_the_distribution_they_are_drawn_from():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -3.0]])
    n = 20_000
    batch = sampler(*(SamplingParams(temperature=0.7, sampling_seed=s) for s in range(n)))
    tokens, logprobs = batch.sample(logits.expand(n, -1), torch.Generator())
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    frequency = torch.bincount(tokens, minlength=VOCAB).double() / n
    assert (frequency - expected).abs().max() < 0.015, (frequency, expected)
    torch.testing.assert_close(logprobs, expected.log()[tokens])  # the tempered logprob of what was drawn


def test_seeded_draws_stay_inside_top_k_and_top_p():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, 0.0, 0.0, 0.0]])
    n = 2000
    top_k = sampler(*(SamplingParams(top_k=2, sampling_seed=s) for s in range(n)))
    assert set(top_k.sample(logits.expand(n, -1), torch.Generator())[0].tolist()) == {0, 1}
    top_p = sampler(*(SamplingParams(top_p=0.5, sampling_seed=s) for s in range(n)))
    assert set(top_p.sample(logits.expand(n, -1), torch.Generator())[0].tolist()) == {0, 1}


def test_the_uniforms_are_a_function_of_seed_draw_and_entry_alone():
    seeds = torch.tensor([5, 5, -(2**63), 2**63 - 1])
    u = seeded_uniforms(seeds, torch.tensor([0, 1, 0, 0]), 1000)
    assert ((u > 0) & (u < 1)).all()
    assert not torch.equal(u[0], u[1]), "the next draw of a seed is new noise"
    torch.testing.assert_close(u, seeded_uniforms(seeds, torch.tensor([0, 1, 0, 0]), 1000), rtol=0, atol=0)
    assert abs(u.mean().item() - 0.5) < 0.02


@pytest.mark.parametrize("seed", ["7", 1.5, True, 2**63, -(2**63) - 1])
def test_a_sampling_seed_that_is_not_a_64_bit_integer_is_refused(seed):
    with pytest.raises(RequestError, match=r"sampling_params\.sampling_seed must be an integer in \[-2\*\*63"):
        SamplingParams.from_json({"max_new_tokens": 4, "sampling_seed": seed})


def test_the_server_gives_a_seeded_request_the_same_tokens_in_any_batch(server):
    def body(seed):
        params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}
        return {"input_ids": [5, 6, 7], "sampling_params": params}

    alone = server.generate_many([body(42)])[0]["output_ids"]
    crowd = server.generate_many([body(1), body(42), body(2), body(None), body(42)])
    outputs = [answer["output_ids"] for answer in crowd]
    assert outputs[1] == outputs[4] == alone
    assert outputs[0] != alone and outputs[2] != alone
