"""The multi-turn workflow against a real CPU inference server, with rewards the tests script.

A recording client (the real one, plus a log of each generate call) tells what the server returned
per turn, so a trajectory can be checked token by token against it.
"""

import asyncio
import copy

import pytest

from hpcrl.config.schema import AlgorithmConfig
from hpcrl.controller.batch import to_sequences
from hpcrl.inference.client import InferenceClient
from hpcrl.models.tiny import make_tokenizer
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.reward.outcome import RewardOutcome
from hpcrl.rollout.workflows.base import version_number
from hpcrl.rollout.workflows.multi_turn import MultiTurn, feedback_ids, feedback_text

FEEDBACK = " no, again: "
PROMPT, ANSWER = "3+4=", "7"
TURN = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}  # every turn exactly 3 tokens


class Recording(InferenceClient):
    """The real client; ``calls`` holds (input_ids, result) of every answered generate, ``sent`` counts requests."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []
        self.sent = 0

    async def generate(self, input_ids, sampling_params, **kwargs):
        self.sent += 1
        result = await super().generate(input_ids, sampling_params, **kwargs)
        self.calls.append((list(input_ids), result))
        return result


class Scripted:
    """A reward whose n-th call scores ``values[n]`` (the last value repeats); records what it read."""

    def __init__(self, *values, error=None):
        self.values, self.error, self.read = values, error, []

    async def score(self, items):
        outcomes = []
        for item in items:
            self.read.append(item)
            if self.error:
                outcomes.append(RewardOutcome(error=self.error))
            else:
                outcomes.append(RewardOutcome(self.values[min(len(self.read), len(self.values)) - 1]))
        return outcomes


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    assert tokenizer.chat_template, "the tiny model's tokenizer has a chat template"
    return tokenizer


@pytest.fixture(scope="module")
def plain_tokenizer(chat_tokenizer):
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = None
    return tokenizer


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def resumed_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


async def rollout(server, tokenizer, rewards, group_size=1, sampling=TURN, **options):
    """One episode on ``server``; the group and the client's record of what the server returned."""
    options = {"max_turns": 3, "turn_discount": 0.5, "feedback": FEEDBACK, **options}
    async with Recording([server.address]) as client:
        workflow = MultiTurn(client, tokenizer, sampling, group_size, rewards, resumed_event(), **options)
        group = await workflow.run(PROMPT, ANSWER)
    return group, client.calls


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("path", ["chat", "plain"])
def test_a_trajectory_is_the_server_turns_and_the_feedback_as_token_ids(server, request, path):
    tokenizer = request.getfixturevalue(f"{path}_tokenizer")
    # the tiny template renders a user turn as "user: ...\n" and the generation prompt as "assistant: "
    feedback = ids(tokenizer, f"user: {FEEDBACK}\nassistant: " if path == "chat" else FEEDBACK)
    rewards = Scripted(0.0)
    group, calls = run(rollout(server, tokenizer, rewards))
    [sample] = group.samples
    prompt_ids = ids(tokenizer, PROMPT)
    assert group.prompt_ids == prompt_ids and len(calls) == 3 and sample.turns == 3
    turns = [result.output_ids for _, result in calls]
    assert sample.output_ids == turns[0] + feedback + turns[1] + feedback + turns[2]
    # each turn was generated from the history as ids: the prompt and everything after it so far
    assert [sent for sent, _ in calls] == [
        prompt_ids,
        prompt_ids + turns[0] + feedback,
        prompt_ids + turns[0] + feedback + turns[1] + feedback,
    ]
    gap = [0] * len(feedback)
    assert sample.mask() == [1] * 3 + gap + [1] * 3 + gap + [1] * 3
    lps = [result.logprobs for _, result in calls]
    assert sample.logprobs == lps[0] + [0.0] * len(feedback) + lps[1] + [0.0] * len(feedback) + lps[2]
    assert sample.versions == [0] * 3 + [-1] * len(feedback) + [0] * 3 + [-1] * len(feedback) + [0] * 3
    last = tokenizer.decode(turns[2], skip_special_tokens=True)
    assert sample.text == last and rewards.read[-1] == (PROMPT, last, ANSWER, {}), "the reward reads the last turn"
    assert [text for _, text, *_ in rewards.read] == [tokenizer.decode(t, skip_special_tokens=True) for t in turns]


@pytest.mark.parametrize(
    ("script", "turns", "reward"),
    [
        ((1.0,), 1, 1.0),  # right at once: no feedback turn
        ((0.0, 1.0), 2, 0.5),  # right at the second turn: discounted once
        ((0.0, 0.0, 1.0), 3, 0.25),
        ((0.0,), 3, 0.0),  # never right: the turn limit ends it
        ((0.6,), 3, 0.15),  # partly right counts as wrong, and the last turn's reward is discounted
    ],
)
def test_turns_end_at_a_right_answer_or_the_limit_and_the_reward_is_discounted(
    server, chat_tokenizer, script, turns, reward
):
    group, calls = run(rollout(server, chat_tokenizer, Scripted(*script)))
    [sample] = group.samples
    assert (sample.turns, len(calls)) == (turns, turns)
    assert sample.reward == pytest.approx(reward) and sample.reward_error is None
    assert sum(sample.mask()) == 3 * turns


def test_a_failed_reward_ends_the_trajectory_with_its_error(server, chat_tokenizer):
    group, calls = run(rollout(server, chat_tokenizer, Scripted(error="raised ValueError: bad")))
    [sample] = group.samples
    assert (sample.turns, len(calls), sample.reward, sample.reward_error) == (1, 1, None, "raised ValueError: bad")


def test_a_group_runs_its_trajectories_concurrently_without_sharing_state(server, chat_tokenizer):
    group, calls = run(rollout(server, chat_tokenizer, Scripted(0.0), group_size=4, max_turns=2))
    assert len(group.samples) == 4 and len(calls) == 8
    assert [sent for sent, _ in calls].count(group.prompt_ids) == 4, "four first turns, four second turns"
    n_feedback = len(group.samples[0].output_ids) - 6
    for sample in group.samples:
        assert sample.turns == 2 and sample.mask() == [1] * 3 + [0] * n_feedback + [1] * 3
    assert len({id(s.output_ids) for s in group.samples}) == 4


def test_to_sequences_trains_on_the_model_turns_only(server, chat_tokenizer):
    group, _ = run(rollout(server, chat_tokenizer, Scripted(0.0, 1.0), group_size=2))
    sequences = to_sequences([group], AlgorithmConfig(group_size=2))
    n = len(group.prompt_ids)
    for seq, sample in zip(sequences, group.samples, strict=True):
        assert seq.input_ids == group.prompt_ids + sample.output_ids
        assert seq.loss_mask == [0] * n + sample.mask()
        assert seq.old_logprobs == [0.0] * n + sample.logprobs
        assert seq.versions == [-1] * n + sample.versions
    assert 0 in group.samples[0].mask() or 0 in group.samples[1].mask(), "a second turn, after feedback"


def test_an_abort_mid_turn_is_resumed_from_the_history_and_its_partial_tokens(long_server, chat_tokenizer):
    """A weight update (same weights, version 7) pauses the servers in abort mode during the second turn."""
    budget = 300  # half a second of generation on an idle machine (more under load): the pause lands mid-turn
    sampling = {**TURN, "max_new_tokens": budget}

    async def scenario():
        resumed = resumed_event()
        async with Recording([long_server.address]) as client:
            workflow = MultiTurn(
                client, chat_tokenizer, sampling, 1, Scripted(0.0), resumed,
                max_turns=2, turn_discount=0.5, feedback=FEEDBACK,
            )  # fmt: skip
            episode = asyncio.create_task(workflow.run(PROMPT, ANSWER))
            while client.sent < 2:  # the second turn is on its way
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # time enough to reach the server, not to finish
            resumed.clear()
            await client.pause("abort")
            await client.update_weights_from_disk(str(long_server.model), weight_version=7)
            await client.resume()
            resumed.set()
            return await episode, client.calls

    group, calls = run(scenario())
    [sample] = group.samples
    assert [result.finish_reason for _, result in calls] == ["length", "abort", "length"]
    (first, turn1), (second, partial), (rest, turn2) = calls
    assert rest == second + partial.output_ids, "resumed from the history plus the partial tokens"
    assert len(partial.output_ids) + len(turn2.output_ids) == budget, "the rest of the turn's budget"
    n_feedback = len(second) - len(first) - budget
    assert sample.output_ids == turn1.output_ids + second[-n_feedback:] + partial.output_ids + turn2.output_ids
    assert sample.mask() == [1] * budget + [0] * n_feedback + [1] * budget
    before, after = len(partial.output_ids), len(turn2.output_ids)
    assert version_number(turn2.weight_version) == 7
    assert sample.versions == [0] * budget + [-1] * n_feedback + [0] * before + [7] * after
    assert sample.turns == 2 and sample.finish_reason == "length"


def test_feedback_text_follows_the_chat_template(plain_tokenizer):
    tokenizer = copy.deepcopy(plain_tokenizer)
    assert feedback_text(tokenizer, FEEDBACK) == FEEDBACK, "no template: the feedback as it is"
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'system' %}[sys: be brief]{% endif %}"  # a default system prompt
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert feedback_text(tokenizer, FEEDBACK) == f"<user>{FEEDBACK}</><assistant>", "no system prompt again"
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}.{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        feedback_text(tokenizer, FEEDBACK)


def test_feedback_the_tokenizer_cannot_spell_is_reported(caplog):
    tokenizer = make_tokenizer("0123456789+=")  # a tiny model's alphabet without the feedback's letters
    tokenizer.chat_template = None
    assert feedback_ids(make_tokenizer(), FEEDBACK) and not caplog.records
    feedback_ids(tokenizer, FEEDBACK)
    assert f"the feedback turn {FEEDBACK!r} is tokenised as" in caplog.text
