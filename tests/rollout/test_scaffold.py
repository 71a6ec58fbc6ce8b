"""Scaffolding controllers: their choices (scripted client), trajectories, and concurrent episodes on a real server.

The functions at the top are rewards and verifiers for the reward processes, named
``tests.rollout.test_scaffold:NAME``: their values say what they were called with.
"""

import asyncio

import pytest

from hpcrl.config.schema import AlgorithmConfig, Config, RewardConfig, RolloutConfig, WorkflowConfig
from hpcrl.controller.evaluate import controller_accuracy
from hpcrl.inference.client import GenerateResult, InferenceClient
from hpcrl.models.tiny import make_tokenizer
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.reward.builtin import extract_answer
from hpcrl.reward.outcome import RewardOutcome
from hpcrl.reward.pool import RewardPool
from hpcrl.rollout.workflows.base import sampling_params
from hpcrl.rollout.workflows.scaffold import (
    BestOfN,
    Episode,
    Generate,
    MajorityVote,
    Pipeline,
    ScaffoldWorkflow,
    Stage,
    runs_per_group,
    scaffold_workflow,
)

TAGGED = "tests.rollout.test_scaffold:tagged"
EPISODES = 64


def tagged(prompt: str, completion: str, answer: str) -> float:
    """answer * 1000 + (10a + b) * 10 + a digest of the completion, for a prompt "a+b=": every argument shows."""
    a, b = int(prompt[0]), int(prompt[2])
    return int(answer) * 1000 + (10 * a + b) * 10 + digest(completion)


def digest(text: str) -> int:
    return sum(map(ord, text)) % 10


def episode_rows(count: int = EPISODES) -> list[tuple[str, str]]:
    """Distinct prompts "a+b=" whose answer is the episode's number, 10a + b (what ``tagged`` reads twice)."""
    return [(f"{i // 10}+{i % 10}=", str(i)) for i in range(count)]


def run(coro, timeout_s: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


# ---- choices and trajectories, with a scripted client


class ScriptedClient:
    """Answers generate requests in order with scripted (text, finish_reason) replies; records every request."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.requests = tokenizer, list(replies), []

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.requests.append((list(input_ids), dict(sampling_params)))
        text, reason = self.replies.pop(0)
        ids = [self.tokenizer.eos_token_id if c == "$" else self.ids(c)[0] for c in text]  # "$": end of sequence
        return GenerateResult(ids, [-0.5] * len(ids), reason, "3", "fake", {})

    def ids(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class ByValue:
    """A verifier scoring a completion by its number; "x" fails, as a raising verifier would."""

    def __init__(self):
        self.calls = []

    async def score(self, items):
        self.calls.append(list(items))
        return [RewardOutcome(error="raised ValueError") if c == "x" else RewardOutcome(float(c)) for _, c, *_ in items]


SCRIPTED = {"max_new_tokens": 4, "temperature": 1.0}


def scripted(*texts, reason="stop"):
    tokenizer = make_tokenizer()
    client = ScriptedClient(tokenizer, [(t, reason) for t in texts])
    return client, tokenizer


def generate(client, tokenizer, sampling=SCRIPTED):
    resumed = asyncio.Event()
    resumed.set()
    return Generate(client, tokenizer, sampling, resumed)


def test_best_of_n_chooses_the_verifiers_best_the_first_of_equals_and_a_failed_score_last():
    async def body():
        client, tokenizer = scripted("3", "9", "x", "9")
        verifier = ByValue()
        episode = Episode.of("1+2=", "3", tokenizer, columns={"level": 2})
        result = await BestOfN(generate(client, tokenizer), 4, verifier).run(episode)
        assert [s.text for s in result.samples] == ["3", "9", "x", "9"]
        assert result.scores == (3.0, 9.0, None, 9.0)
        assert result.text == "9" and result.chosen is result.samples[1]
        assert verifier.calls == [[("1+2=", t, "3", {"level": 2}) for t in ("3", "9", "x", "9")]], "with the columns"

        client, tokenizer = scripted("x", "x")
        result = await BestOfN(generate(client, tokenizer), 2, ByValue()).run(Episode.of("1+2=", "3", tokenizer))
        assert result.chosen is result.samples[0], "every score failed: the first candidate"

    run(body())


def test_majority_vote_chooses_the_most_common_answer_and_breaks_ties_by_first_occurrence():
    async def body():
        cases = [
            (("4", "a7", "7", "b", "2"), "a7", 1),  # 7 has two votes; its first run's whole text is chosen
            (("4", "7", "7", "4", "2"), "4", 0),  # 4 and 7 tie: 4 came first
            (("a", "b"), "a", 0),  # no answers at all: the first run
        ]
        for texts, text, index in cases:
            client, tokenizer = scripted(*texts)
            vote = MajorityVote(generate(client, tokenizer), len(texts), extract_answer)
            result = await vote.run(Episode.of("1+2=", "3", tokenizer))
            assert (result.text, result.chosen) == (text, result.samples[index]), texts

    run(body())


def test_a_pipeline_trajectory_is_every_stage_in_one_sequence_with_the_stage_prompts_masked():
    async def body():
        client, tokenizer = scripted("5$", "7")  # stage 1 ends with the end-of-sequence token
        stages = [Stage(t, generate(client, tokenizer)) for t in ("{prompt}", "{prompt}{previous}|")]
        episode = Episode.of("2+3=", "5", tokenizer)
        result = await Pipeline(stages, tokenizer).run(episode)
        ids = client.ids
        stage1, extra, stage2 = [*ids("5"), tokenizer.eos_token_id], ids("|"), ids("7")
        (trajectory,) = result.samples
        assert result.chosen is trajectory and result.text == trajectory.text == "7"
        assert trajectory.output_ids == stage1 + extra + stage2
        assert trajectory.mask() == [1, 1, 0, 1]
        assert trajectory.versions == [3, 3, -1, 3] and trajectory.logprobs == [-0.5, -0.5, 0.0, -0.5]
        assert trajectory.turns == 2
        # the model conditioned on exactly the training sequence
        assert [r[0] for r in client.requests] == [list(episode.prompt_ids), [*episode.prompt_ids, *stage1, *extra]]

    run(body())


def test_a_stage_prompt_that_does_not_extend_the_sequence_is_appended_whole():
    async def body():
        client, tokenizer = scripted("5", "ok")
        stages = [Stage(t, generate(client, tokenizer)) for t in ("{prompt}", " check {previous}:")]
        result = await Pipeline(stages, tokenizer).run(Episode.of("2+3=", "5", tokenizer))
        ids = client.ids
        assert result.chosen.output_ids == ids("5") + ids(" check 5:") + ids("ok")
        assert result.chosen.mask() == [1] + [0] * len(" check 5:") + [1, 1]

    run(body())


def test_a_pipeline_keeps_the_candidates_a_best_of_n_stage_did_not_choose():
    async def body():
        client, tokenizer = scripted("1", "8", "2")
        best = BestOfN(generate(client, tokenizer), 2, ByValue())
        stages = [Stage("{prompt}", best), Stage("{prompt}{previous}|", generate(client, tokenizer))]
        result = await Pipeline(stages, tokenizer).run(Episode.of("2+3=", "5", tokenizer))
        ids = client.ids
        loser, final = result.samples
        assert loser.output_ids == ids("1") and loser.text == "1"
        assert final is result.chosen and final.output_ids == ids("8|2") and final.mask() == [1, 0, 1]

    run(body())


def test_a_bad_stage_template_is_refused_with_its_index():
    with pytest.raises(ValueError, match=r"stage 1 .*\{answer\}"):
        Pipeline([Stage("{prompt}", None), Stage("{answer}", None)], make_tokenizer())


def test_generate_resumes_an_aborted_request_with_the_remaining_budget():
    async def body():
        tokenizer = make_tokenizer()
        client = ScriptedClient(tokenizer, [("4", "abort"), ("2$", "stop")])
        result = await generate(client, tokenizer).run(Episode.of("1+1=", "2", tokenizer))
        assert result.text == "42" and result.chosen.finish_reason == "stop"
        prompt = client.ids("1+1=")
        assert client.requests == [(prompt, SCRIPTED), ([*prompt, *client.ids("4")], {**SCRIPTED, "max_new_tokens": 3})]

    run(body())


class Zero:
    """A task reward that records what it scored."""

    def __init__(self):
        self.items = []

    async def score(self, items):
        self.items += items
        return [RewardOutcome(0.0)] * len(items)


def test_the_group_has_group_size_trajectories_whatever_the_runs_give():
    assert runs_per_group(WorkflowConfig(name="best_of_n", n=4, train_on="all"), 8) == 2
    assert runs_per_group(WorkflowConfig(name="majority_vote", n=4, train_on="chosen"), 8) == 8
    assert runs_per_group(WorkflowConfig(name="pipeline", n=4, train_on="all"), 8) == 8
    with pytest.raises(ValueError, match=r"algorithm.group_size=6 .* must be a multiple of 4"):
        runs_per_group(WorkflowConfig(name="best_of_n", n=4, train_on="all"), 6)


@pytest.mark.parametrize(("train_on", "size"), [("all", 6), ("chosen", 2)])
def test_a_scaffold_group_holds_every_candidate_or_the_chosen_ones(train_on, size):
    async def body():
        client, tokenizer = scripted("1", "2", "3", "4", "5", "6")
        rewards = Zero()
        workflow = ScaffoldWorkflow(BestOfN(generate(client, tokenizer), 3, ByValue()), tokenizer, rewards, 2, train_on)
        group = await workflow.run("1+2=", "3")
        texts = [s.text for s in group.samples]
        assert texts == (["1", "2", "3", "4", "5", "6"] if train_on == "all" else ["3", "6"])
        assert len(group.samples) == size and all(s.reward == 0.0 for s in group.samples)
        assert rewards.items == [("1+2=", t, "3", {}) for t in texts]

    run(body())


# ---- many concurrent episodes on a real CPU server


class RecordingClient:
    """The real client, recording every request: its input ids, sampling parameters and output ids."""

    def __init__(self, client: InferenceClient):
        self.client, self.requests = client, []

    async def generate(self, input_ids, sampling_params, **kwargs):
        result = await self.client.generate(input_ids, sampling_params, **kwargs)
        self.requests.append((tuple(input_ids), dict(sampling_params), tuple(result.output_ids)))
        return result

    def produced(self, context, output) -> bool:
        """Whether one request generated ``output`` right after ``context``."""
        return any(r[0] == tuple(context) and r[2] == tuple(output) for r in self.requests)


GROUP = 4  # trajectories per prompt: 2 runs of 2 candidates (best-of-N, majority vote), 4 pipeline runs
SAMPLING = sampling_params(RolloutConfig(max_new_tokens=3, temperature=1.0, stop=["#"]))


def make_workflow(name, client, tokenizer, rewards, resumed, reward_fn=TAGGED):
    verifier = TAGGED if name == "best_of_n" else ""
    cfg = Config(
        workflow=WorkflowConfig(name=name, n=2, verifier=verifier),
        algorithm=AlgorithmConfig(group_size=GROUP),
        reward=RewardConfig(fn=reward_fn, workers=1),
    )
    return scaffold_workflow(cfg, client, tokenizer, SAMPLING, rewards, resumed)


async def on_server(server, tiny_model, name, scenario, reward_fn=TAGGED):
    """Run ``scenario(workflow, client, tokenizer, rewards)`` with a real client, reward pool and verifier pool."""
    tokenizer = load_tokenizer(tiny_model)
    resumed = asyncio.Event()
    resumed.set()
    with RewardPool(reward_fn, workers=1) as rewards:
        async with InferenceClient([server.address]) as real:
            client = RecordingClient(real)
            workflow = make_workflow(name, client, tokenizer, rewards, resumed, reward_fn)
            try:
                await scenario(workflow, client, tokenizer, rewards)
            finally:
                workflow.close()


def check_trajectory(name, sample, episode, client, tokenizer):
    """The sample was generated after its own episode's prompt; a pipeline's is stage 1 + "|" + stage 2."""
    if name != "pipeline":
        assert client.produced(episode.prompt_ids, sample.output_ids)
        assert sample.mask() == [1] * len(sample.output_ids)
        return
    ids, mask = sample.output_ids, sample.mask()
    k = mask.index(0)
    assert mask == [1] * k + [0] + [1] * (len(ids) - k - 1)
    assert tokenizer.decode(ids[k : k + 1]) == "|"
    assert sample.versions == [0 if m else -1 for m in mask]
    assert client.produced(episode.prompt_ids, ids[:k])
    assert client.produced(episode.prompt_ids + tuple(ids[: k + 1]), ids[k + 1 :])
    assert sample.text == tokenizer.decode(ids[k + 1 :], skip_special_tokens=True)


@pytest.mark.parametrize("name", ["best_of_n", "majority_vote", "pipeline"])
def test_concurrent_episodes_keep_their_prompts_tokens_and_rewards(server, tiny_model, name):
    rows = episode_rows()

    async def scenario(workflow, client, tokenizer, rewards):
        groups = await asyncio.gather(*(workflow.run(p, a) for p, a in rows))
        for (prompt, answer), group in zip(rows, groups, strict=True):
            episode = Episode.of(prompt, answer, tokenizer)
            assert (group.prompt, group.answer) == (prompt, answer)
            assert tokenizer.decode(group.prompt_ids) == prompt
            assert len(group.samples) == GROUP
            for sample in group.samples:
                check_trajectory(name, sample, episode, client, tokenizer)
                assert sample.reward == tagged(prompt, sample.text, answer), (prompt, sample.text, sample.reward)

    run(on_server(server, tiny_model, name, scenario))


@pytest.mark.parametrize("name", ["best_of_n", "majority_vote"])
def test_concurrent_controller_runs_choose_among_their_own_candidates(server, tiny_model, name):
    rows = episode_rows()

    async def scenario(workflow, client, tokenizer, rewards):
        episodes = [Episode.of(p, a, tokenizer) for p, a in rows]
        results = await asyncio.gather(*(workflow.controller.run(e) for e in episodes))
        for episode, result in zip(episodes, results, strict=True):
            texts = [s.text for s in result.samples]
            for sample in result.samples:
                check_trajectory(name, sample, episode, client, tokenizer)
            if name == "best_of_n":  # the verifier was called with this episode's prompt, answer and candidates
                assert result.scores == tuple(tagged(episode.prompt, t, episode.answer) for t in texts)
            else:
                answers = [extract_answer(t) for t in texts]
                assert result.scores == tuple(answers.count(a) if a is not None else 0 for a in answers)
            assert result.chosen is result.samples[result.scores.index(max(result.scores))]
            assert result.text == result.chosen.text

    run(on_server(server, tiny_model, name, scenario))


@pytest.mark.parametrize("name", ["best_of_n", "majority_vote", "pipeline"])
def test_the_configs_sampling_parameters_reach_the_server_in_rollout_and_eval(server, tiny_model, name):
    rows = episode_rows(4)

    async def scenario(workflow, client, tokenizer, rewards):
        await asyncio.gather(*(workflow.run(p, a) for p, a in rows))
        eval_rows = [{"prompt": p, "answer": str(int(p[0]) + int(p[2]))} for p, _ in rows]
        accuracy = await controller_accuracy(workflow.controller, tokenizer, eval_rows, rewards)
        assert 0.0 <= accuracy <= 1.0
        per_run = 2  # requests: n=2 candidates | 2 stages
        runs = GROUP if name == "pipeline" else GROUP // 2
        assert len(client.requests) == len(rows) * runs * per_run + len(eval_rows) * per_run
        assert all(params == SAMPLING for _, params, _ in client.requests), {str(r[1]) for r in client.requests}

    run(on_server(server, tiny_model, name, scenario, reward_fn="hpcrl.reward.builtin:mod10"))
