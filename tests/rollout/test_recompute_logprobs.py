"""``algorithm.behaviour_logprobs=recompute``: every path that generates training samples asks the servers for no
logprobs (``return_logprob: false``, so SGLang computes none) and its samples carry ``logprobs=None``; with the
default (``server``) every request asks for them and the samples carry one per output token, as before. Against a
fake SGLang server on a real socket that records every request body."""

import pytest

from hpcrl.config.schema import Config
from hpcrl.inference.client import InferenceClient
from hpcrl.models.tiny import make_tokenizer
from hpcrl.reward.outcome import RewardOutcome
from hpcrl.rollout.workflows import close_workflow, make_workflow
from hpcrl.rollout.workflows.base import EpisodeContext
from tests.inference.test_client_fakes import fake_servers
from tests.rollout.test_multi_turn import resumed_event, run

PLUGIN = "tests.rollout.test_recompute_logprobs:two_completions"


class Wrong:
    """Every answer scores 0: a multi-turn trajectory takes all its turns."""

    async def score(self, items):
        return [RewardOutcome(0.0) for _ in items]


async def two_completions(ep: EpisodeContext) -> float:
    """A plug-in episode: a completion, then one whose request asks for OpenAI's ``logprobs`` itself (an assert that
    fails here fails the episode, and so the test)."""
    await ep.client.completions.create(model=ep.model, prompt=ep.prompt, max_tokens=2)
    reply = await ep.client.completions.create(model=ep.model, prompt=ep.prompt + "1", max_tokens=2, logprobs=0)
    assert reply.choices[0].logprobs.token_logprobs == [-0.5, -1.0], "the agent gets the logprobs it asked for"
    return 0.0


def config(name: str, behaviour_logprobs: str) -> Config:
    cfg = Config()
    cfg.workflow.name, cfg.workflow.n = name, 2
    cfg.algorithm.group_size, cfg.algorithm.behaviour_logprobs = 2, behaviour_logprobs
    cfg.rollout.max_new_tokens = 3
    return cfg


async def episode(name: str, behaviour_logprobs: str):
    """One episode of workflow ``name``: its samples, and the return_logprob of each /generate body sent."""
    async with fake_servers(1) as (fake,):
        async with InferenceClient([fake.address], max_retries=0) as client:
            workflow = make_workflow(
                config(name, behaviour_logprobs), client, make_tokenizer(), Wrong(), resumed_event()
            )
            try:
                group = await workflow.run("3+4=", "7", seed=5)
            finally:
                await close_workflow(workflow)
                getattr(workflow, "close", lambda: None)()  # a scaffold's verifier pool
        return group.samples, [body["return_logprob"] for body in fake.bodies("/generate")]


WORKFLOWS = ["single_turn", "multi_turn", "best_of_n", "pipeline", PLUGIN]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_under_recompute_no_request_asks_for_logprobs_and_no_sample_carries_any(name):
    samples, asked = run(episode(name, "recompute"))
    if name == PLUGIN:  # the agent's own logprobs=0 request is answered with them, and still not recorded
        assert sorted(asked) == [False, False, True, True]  # two episodes at once
    else:
        assert asked and not any(asked), asked
    assert samples and all(s.logprobs is None for s in samples), [s.logprobs for s in samples]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_by_default_every_request_asks_for_logprobs_and_every_sampled_token_has_one(name):
    samples, asked = run(episode(name, "server"))
    assert asked and all(a is True for a in asked), asked
    for s in samples:  # the fake server's logprobs are -0.5, -1.0, ... per answer; 0.0 for tokens not sampled
        assert len(s.logprobs) == len(s.output_ids)
        assert all((lp < 0) == bool(m) for lp, m in zip(s.logprobs, s.mask(), strict=True)), (s.logprobs, s.mask())
