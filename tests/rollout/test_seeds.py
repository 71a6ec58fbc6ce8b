"""Every rollout request carries a sampling seed derived from the episode's seed and its place in the episode
(sample, turn, run, stage, tokens already generated); the same seed gives the same samples on a real server."""

import asyncio

import pytest

from hpcrl.config.schema import WorkflowConfig
from hpcrl.inference.client import GenerateResult, InferenceClient
from hpcrl.models.tiny import make_tokenizer
from hpcrl.reward.outcome import RewardOutcome
from hpcrl.rollout.workflows.base import derive_seed
from hpcrl.rollout.workflows.multi_turn import MultiTurn
from hpcrl.rollout.workflows.scaffold import Generate, ScaffoldWorkflow, make_controller
from hpcrl.rollout.workflows.single_turn import SingleTurn

SAMPLING = {"max_new_tokens": 4, "temperature": 1.0}


class Recorder:
    """A client that answers every request with ``tokens`` tokens (an abort first when ``abort_first``) and
    records the sampling parameters of each."""

    def __init__(self, tokens: int = 4, abort_first: bool = False):
        self.params: list[dict] = []
        self.tokens, self.abort_first = tokens, abort_first

    async def generate(self, input_ids, sampling_params, **kwargs):
        self.params.append(dict(sampling_params))
        n, reason = sampling_params["max_new_tokens"], "length"
        if self.abort_first and len(self.params) == 1:
            n, reason = 1, "abort"
        return GenerateResult([5] * n, [-1.0] * n, reason, "0", "fake:1", {})

    async def generate_many(self, input_ids, sampling_params, **kwargs):
        return [await self.generate(ids, params) for ids, params in zip(input_ids, sampling_params, strict=True)]


class Zero:
    async def score(self, items):
        return [RewardOutcome(0.0) for _ in items]


def resumed() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


def seeds_sent(workflow_of, seed):
    client = Recorder()
    asyncio.run(workflow_of(client).run("1+1=", "2", seed=seed))
    return [p.get("sampling_seed") for p in client.params]


def single_turn(client):
    return SingleTurn(client, make_tokenizer(), SAMPLING, 4, Zero(), resumed())


def multi_turn(client):
    return MultiTurn(client, make_tokenizer(), SAMPLING, 2, Zero(), resumed(), max_turns=3, turn_discount=0.9,
                     feedback=" no: ")  # fmt: skip


def best_of_n(client):
    w = WorkflowConfig(name="best_of_n", n=2, train_on="all")
    controller = make_controller(w, Generate(client, make_tokenizer(), SAMPLING, resumed()), make_tokenizer(), Zero())
    return ScaffoldWorkflow(controller, make_tokenizer(), Zero(), runs=2, train_on="all")


@pytest.mark.parametrize("workflow_of", [single_turn, multi_turn, best_of_n], ids=["single", "multi", "best_of_n"])
def test_every_request_of_an_episode_carries_a_seed_of_its_own_fixed_by_the_episodes(workflow_of):
    sent = seeds_sent(workflow_of, seed=11)
    assert len(sent) == 4 if workflow_of is not multi_turn else len(sent) == 2 * 3
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in sent)
    assert len(set(sent)) == len(sent), "no two requests share a seed"
    assert sorted(seeds_sent(workflow_of, seed=11)) == sorted(sent), "the same episode seed, the same seeds"
    assert set(seeds_sent(workflow_of, seed=12)).isdisjoint(sent)
    assert seeds_sent(workflow_of, seed=None) == [None] * len(sent), "no episode seed: no sampling_seed"


def test_a_request_resubmitted_after_an_abort_gets_the_seed_of_where_it_goes_on():
    client = Recorder(abort_first=True)
    sample = asyncio.run(SingleTurn(client, make_tokenizer(), SAMPLING, 1, Zero(), resumed()).sample([4, 5], seed=3))
    assert len(sample.output_ids) == 4
    assert [p["sampling_seed"] for p in client.params] == [derive_seed(3, 0), derive_seed(3, 1)]
    assert [p["max_new_tokens"] for p in client.params] == [4, 3]


def test_derived_seeds_are_the_same_in_every_process():
    # blake2b of the parts, not Python's salted hash(): a rollout worker or a rerun derives the same seeds
    assert derive_seed(0, "draw", 5) == 6844568363289107685
    assert derive_seed(None, 1) is None


def test_the_same_seed_gives_the_same_samples_on_a_real_server(server):
    async def group(seed):
        async with InferenceClient([server.address]) as client:
            workflow = SingleTurn(client, make_tokenizer(), {**SAMPLING, "max_new_tokens": 6}, 4, Zero(), resumed())
            return [s.output_ids for s in (await workflow.run("3+4=", "7", seed=seed)).samples]

    first, again, other = (asyncio.run(group(seed)) for seed in (21, 21, 22))
    assert first == again
    assert first != other
    assert len({tuple(s) for s in first}) > 1, "the samples of a group differ from one another"


def test_a_rollout_worker_samples_an_episode_by_the_seed_it_is_sent(tiny_model, server, tmp_path):
    from hpcrl.rollout.remote import RemoteEpisodes
    from tests.rollout.test_episode_worker import ROWS, make_run, rollout_workers

    run_dir, token = make_run(tmp_path, tiny_model, server.address)
    scheduler, spec, _ = rollout_workers(run_dir, workers=1)
    with scheduler:
        entries = scheduler.start(spec).wait_ready()

        async def samples(seed):
            async with RemoteEpisodes([e.address for e in entries], token, heartbeat_s=0.5) as remote:
                group = await remote.run(ROWS[0], seed=seed)
                return [s.output_ids for s in group.samples]

        first, again, other = (asyncio.run(samples(seed)) for seed in (5, 5, 6))
    assert first == again and first != other


class AbortsSomeOfTheFirstBatch(Recorder):
    """The first batched request: sample i answers token 5 + i, and samples 1 and 3 come back aborted after one
    token (a weight update's pause); a later request repeats its prompt's last token as often as it was asked
    for. Records each batch's prompts; the weight version is the request's number."""

    def __init__(self):
        super().__init__()
        self.batches: list[list[list[int]]] = []

    async def generate_many(self, input_ids, sampling_params, **kwargs):
        first = not self.batches
        self.batches.append([list(ids) for ids in input_ids])
        results = []
        for i, (ids, params) in enumerate(zip(input_ids, sampling_params, strict=True)):
            self.params.append(dict(params))
            cut = first and i in (1, 3)
            n = 1 if cut else params["max_new_tokens"]
            token = 5 + i if first else ids[-1]
            reason = "abort" if cut else "length"
            results.append(GenerateResult([token] * n, [-1.0] * n, reason, str(len(self.batches)), "fake:1", {}))
        return results


def test_a_groups_aborted_samples_go_on_together_from_their_tokens_and_the_others_are_not_sent_again():
    client = AbortsSomeOfTheFirstBatch()
    group = asyncio.run(SingleTurn(client, make_tokenizer(), SAMPLING, 4, Zero(), resumed()).run("1+1=", "2", seed=5))
    prompt = group.prompt_ids
    assert client.batches == [[prompt] * 4, [[*prompt, 6], [*prompt, 8]]], "only samples 1 and 3, from their token"
    assert [p["max_new_tokens"] for p in client.params[4:]] == [3, 3], "the rest of their budget"
    assert [s.output_ids for s in group.samples] == [[5] * 4, [6] * 4, [7] * 4, [8] * 4]
    assert group.samples[1].versions == [1, 2, 2, 2], "the weight version of each token"
    assert [s.finish_reason for s in group.samples] == ["length"] * 4
