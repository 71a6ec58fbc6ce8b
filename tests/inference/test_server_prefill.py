"""The CPU server's prefill: a batch prefills each distinct prompt once (a GRPO group sends one prompt n times),
and every row gets what a prefill of its prompt alone gives: the same first token and logprob, the same KV
cache, the same tokens after. And the torch threads the server takes by default."""

import os

import pytest
import torch

from hpcrl.inference.server.__main__ import parse_args, set_torch_threads
from hpcrl.inference.server.runner import ModelRunner, _kv
from hpcrl.inference.server.sampling import BatchSampler, SamplingParams


class CountingModel:
    """The runner's model, recording how many rows each forward computes."""

    def __init__(self, model):
        self.model, self.rows = model, []

    def __call__(self, *, input_ids, **kwargs):
        self.rows.append(input_ids.shape[0])
        return self.model(input_ids=input_ids, **kwargs)


@pytest.fixture(scope="module")
def runner(tiny_model):
    runner = ModelRunner(str(tiny_model))
    runner.model = CountingModel(runner.model)
    return runner


def prefill(runner: ModelRunner, prompts: list[list[int]], params: list[SamplingParams]):
    sampler = BatchSampler.of(params, runner.vocab_size)
    return runner.prefill(list(range(len(prompts))), prompts, sampler)


def test_a_repeated_prompt_is_prefilled_once_and_each_row_matches_its_prompt_alone(runner):
    p, q, r = [5, 6, 7], [8, 9, 10, 11, 12], [13]
    prompts = [p, q, p, p, r, q]
    params = [SamplingParams(temperature=0) for _ in prompts]
    runner.model.rows.clear()
    batch = prefill(runner, prompts, params)
    assert runner.model.rows == [3], "one forward over the 3 distinct prompts"
    width = batch.attention_mask.shape[1]
    assert width == 5
    for row, prompt in enumerate(prompts):
        alone = prefill(runner, [prompt], [SamplingParams(temperature=0)])
        assert batch.tokens[row].item() == alone.tokens[0].item(), f"row {row}"
        assert batch.logprobs[row].item() == pytest.approx(alone.logprobs[0].item(), abs=1e-5)
        assert batch.attention_mask[row].tolist() == [0] * (width - len(prompt)) + [1] * len(prompt)
        assert batch.positions[row].item() == len(prompt) - 1
        for (k, v), (k1, v1) in zip(_kv(batch.cache), _kv(alone.cache), strict=True):
            assert torch.allclose(k[row, :, width - len(prompt) :], k1[0], atol=1e-5), f"row {row}: keys"
            assert torch.allclose(v[row, :, width - len(prompt) :], v1[0], atol=1e-5), f"row {row}: values"
    # three decode steps of the whole batch give every row its prompt's greedy continuation
    alone_states = [prefill(runner, [prompt], [SamplingParams(temperature=0)]) for prompt in prompts]
    for _ in range(3):
        runner.decode(batch)
        for row, state in enumerate(alone_states):
            runner.decode(state)
            assert batch.tokens[row].item() == state.tokens[0].item(), f"row {row}"
            assert batch.logprobs[row].item() == pytest.approx(state.logprobs[0].item(), abs=1e-5)


def test_rows_of_one_prompt_with_their_own_seeds_draw_as_they_would_alone(runner):
    prompt = [20, 21, 22, 23]
    seeds = [11, 12, 13, 14, 15, 16, 17, 11]
    params = [SamplingParams(temperature=1.0, sampling_seed=s) for s in seeds]
    runner.model.rows.clear()
    batch = prefill(runner, [prompt] * len(seeds), params)
    assert runner.model.rows == [1]
    alone = [prefill(runner, [prompt], [p]) for p in params]
    assert batch.tokens.tolist() == [a.tokens[0].item() for a in alone]
    assert torch.allclose(batch.logprobs, torch.cat([a.logprobs for a in alone]), atol=1e-5)
    assert batch.tokens[0] == batch.tokens[7], "the same seed draws the same token"
    assert len(set(batch.tokens.tolist())) > 1, "other seeds draw from the same logits, not one shared token"


def test_the_server_leaves_the_http_loop_a_core_by_default():
    assert parse_args(["--model-path", "m", "--port", "1"]).torch_threads == 0
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--port", "1", "--torch-threads", "-1"])
    before = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
        assert set_torch_threads(0) == max(1, cores - 1) == torch.get_num_threads()
        assert set_torch_threads(3) == 3 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
        torch.set_flush_denormal(False)  # set_torch_threads flushes subnormals for the whole process: not past here
