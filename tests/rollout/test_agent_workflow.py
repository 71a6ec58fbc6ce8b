"""A plug-in episode as a workflow (``AgentWorkflow``), against a real CPU server through the proxy: what hpcrl trains
on is, token for token, what the server generated and what came between the turns, masked on the model's tokens
only; conversations a template re-renders are split and counted; rewards propagate with the discount; a reward
that fails marks the run's samples failed; an episode that breaks the contract fails naming why."""

import asyncio

import openai
import pytest

from hpcrl.inference.client import ContextLengthError
from hpcrl.inference.openai.chat import ChatFormat
from hpcrl.inference.openai.templates import TINY_TOOLS
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.rollout.workflows.agent import AgentWorkflow, EpisodeFailed
from hpcrl.rollout.workflows.base import derive_seed, version_number
from tests.rollout.test_multi_turn import Recording, Scripted, resumed_event, run

PROMPT, ANSWER = "3+4=", "7"
SAMPLING = {"max_new_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": -1}  # the rollout's
# every turn is 3 tokens, and its text (special tokens written out) renders back to the same ids
EXACT = {"ignore_eos": True, "skip_special_tokens": False}
BETWEEN = [{"role": "tool", "tool_call_id": "call_0", "content": "7"}, {"role": "user", "content": "="}]


async def converse(ep, after_first=None) -> list:
    """user, assistant, tool, assistant, user, assistant: the replies, each turn sent back as its content;
    ``after_first()`` runs between the first and the second turn."""
    messages, replies = [{"role": "user", "content": ep.prompt}], []
    for between in [*BETWEEN, None]:
        reply = await ep.client.chat.completions.create(
            model=ep.model, messages=messages, extra_body=EXACT, **ep.sampling
        )
        replies.append(reply)
        if between is None:
            return replies
        if after_first is not None and len(replies) == 1:
            await after_first()
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, between]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def rollout(
    server, make_episode, *, template="tiny_tools", group_size=1, rewards=None, context_length=None, **options
):
    """One row's group (seed 5) of ``make_episode(client)``; the client's record of every generate answered."""
    tokenizer = load_tokenizer(server.model)
    async with Recording([server.address], max_retries=0, context_length=context_length) as client:
        chat = ChatFormat(tokenizer, template, "tiny")
        rewards = rewards or Scripted(1.0)
        workflow = AgentWorkflow(
            make_episode(client), client, tokenizer, chat, SAMPLING, group_size, rewards, resumed_event(), **options
        )
        try:
            return await workflow.run(PROMPT, ANSWER, 5), client.calls
        finally:
            await workflow.aclose()


def calls_of(full: list[int], calls) -> list:
    """The generate calls a trajectory is made of: those whose prompt and output it starts with, in order."""
    mine = [(sent, r) for sent, r in calls if full[: len(sent) + len(r.output_ids)] == sent + r.output_ids]
    return sorted(mine, key=lambda call: len(call[0]))


def test_a_three_turn_conversation_trains_as_the_servers_tokens_masked_on_the_models_turns(agent_server):
    tokenizer = load_tokenizer(agent_server.model)
    version = version_number(agent_server.get("/model_info")[1]["weight_version"]) + 1
    seen = {}

    updated = asyncio.Event()

    def make_episode(client):
        async def update():  # the server's weights change between episode 0's first and second turns
            await client.update_weights_from_disk(str(agent_server.model), weight_version=version)
            updated.set()

        async def episode(ep):
            seen[ep.index] = ep
            if ep.index == 1:  # no request in flight during the update: SGLang's cache flush refuses one (a 400)
                await updated.wait()
            replies = await converse(ep, update if ep.index == 0 else None)
            return await ep.score(replies[-1].choices[0].message.content)

        return episode

    rewards = Scripted(1.0)
    group, calls = run(rollout(agent_server, make_episode, group_size=2, rewards=rewards))

    prompt_ids = ids(tokenizer, PROMPT)
    assert group.prompt_ids == prompt_ids and len(group.samples) == 2 and len(calls) == 6
    counts = {"agent_completions": 6, "agent_turns_joined": 4, "agent_trajectories": 2, "agent_tool_calls": 0}
    assert group.counts == counts
    for sample in group.samples:
        full = prompt_ids + sample.output_ids
        (p1, r1), (p2, r2), (p3, r3) = calls_of(full, calls)
        # each turn's prompt is the last one, its output and what came between, as the template wrote it
        assert p2 == p1 + r1.output_ids + ids(tokenizer, "7=") and p3 == p2 + r2.output_ids + ids(tokenizer, "=")
        assert full == p3 + r3.output_ids, "what is trained on is the last turn's prompt and output"
        mask, logprobs, versions = [0] * len(full), [0.0] * len(full), [-1] * len(full)
        for sent, result in ((p1, r1), (p2, r2), (p3, r3)):
            at = slice(len(sent), len(sent) + len(result.output_ids))
            mask[at] = [1] * len(result.output_ids)
            logprobs[at] = result.logprobs
            versions[at] = [version_number(result.weight_version)] * len(result.output_ids)
        n = len(prompt_ids)
        assert sample.loss_mask == mask[n:] and sum(sample.loss_mask) == 9
        assert sample.logprobs == logprobs[n:] and sample.versions == versions[n:]
        assert (sample.turns, sample.finish_reason, sample.reward, sample.reward_error) == (3, "length", 1.0, None)
        assert sample.text == tokenizer.decode(r3.output_ids)
    first = calls_of(prompt_ids + group.samples[0].output_ids, calls)
    assert [version_number(r.weight_version) for _, r in first] == [version - 1, version, version], "the update shows"
    assert sorted(text for _, text, *_ in rewards.read) == sorted(s.text for s in group.samples)
    for i, ep in seen.items():  # what each episode was given
        assert ep.row == {"prompt": PROMPT, "answer": ANSWER, "columns": {}}
        assert ep.index == i and ep.model == "hpcrl-policy"
        assert ep.seed == derive_seed(5, "sample", i) and ep.sampling == {
            "temperature": 1.0,
            "top_p": 1.0,
            "max_tokens": 3,
        }
        assert str(ep.client.base_url).rstrip("/") == ep.base_url and "/e/" in ep.base_url
    assert seen[0].base_url != seen[1].base_url, "each run has an endpoint of its own"


# A template that writes the conversation's length first: every turn re-renders the earlier ones differently
COUNTED = "{{ messages | length }}" + TINY_TOOLS


@pytest.mark.parametrize(
    ("middle", "expected"),
    [
        (0.8, [0.4, 0.8, 1.0]),  # set_reward on the middle completion; the first gets half of it
        (None, [0.25, 0.5, 1.0]),  # only the returned reward, halved per completion back
    ],
)
def test_turns_a_template_rewrites_are_separate_trajectories_each_with_its_discounted_reward(
    agent_server, tmp_path, middle, expected
):
    tokenizer = load_tokenizer(agent_server.model)
    template = tmp_path / "counted.jinja"
    template.write_text(COUNTED)

    async def episode(ep):
        replies = await converse(ep)
        if middle is not None:
            ep.set_reward(replies[1].id, middle)
        return 1.0

    group, calls = run(rollout(agent_server, lambda _: episode, template=str(template), turn_discount=0.5))
    counts = {"agent_completions": 3, "agent_turns_joined": 0, "agent_trajectories": 3, "agent_tool_calls": 0}
    assert group.counts == counts and len(calls) == 3
    assert group.prompt_ids == [], "the three trajectories start with 1, 3 and 5: no token in common"
    assert [s.reward for s in group.samples] == pytest.approx(expected, abs=0)
    for sample, (sent, result), length in zip(group.samples, calls, "135", strict=True):
        assert sent[:1] == ids(tokenizer, length), "the template wrote the conversation's length first"
        assert sample.output_ids == sent + result.output_ids, "each trajectory is its own turn's prompt and output"
        assert sample.loss_mask == [0] * len(sent) + [1] * len(result.output_ids)
        assert sample.logprobs == [0.0] * len(sent) + result.logprobs
        assert (sample.turns, sample.reward_error) == (1, None)


async def one_turn(ep):
    reply = await ep.client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": ep.prompt}])
    return reply


def test_a_run_without_a_reward_for_every_completion_has_its_samples_failed_not_scored_zero(agent_server):
    async def episode(ep):
        first = await one_turn(ep)
        if ep.index == 0:
            ep.set_reward(first.id, 1.0)
            await one_turn(ep)  # a second completion, after the one that has a reward: it has none
            return None
        if ep.index == 1:
            return "high"  # not a number
        return 0.0

    group, _ = run(rollout(agent_server, lambda _: episode, group_size=3))
    # tiny_tools: a second question is a conversation of its own (its prompt does not extend the first answer)
    runs = [group.samples[:2], group.samples[2:3], group.samples[3:]]
    assert group.counts["agent_trajectories"] == 4 and [len(r) for r in runs] == [2, 1, 1]
    for sample in runs[0]:
        assert sample.reward is None and "1 of 2 completions have no reward" in sample.reward_error
    [not_a_number] = runs[1]
    assert not_a_number.reward is None and not_a_number.reward_error.startswith("the episode returned str 'high'")
    [scored] = runs[2]
    assert (scored.reward, scored.reward_error) == (0.0, None), "a reward of 0 is a reward"


def test_a_reward_function_that_fails_marks_the_run_failed_with_its_message(agent_server):
    async def episode(ep):
        reply = await one_turn(ep)
        return await ep.score(reply.choices[0].message.content)

    rewards = Scripted(error="mod10: the reference answer is empty; expected a digit")
    group, _ = run(rollout(agent_server, lambda _: episode, group_size=2, rewards=rewards))
    assert [(s.reward, s.reward_error) for s in group.samples] == [(None, rewards.error)] * 2


def test_an_episode_that_gave_up_on_a_prompt_too_long_fails_with_the_proxys_cause(agent_server):
    async def episode(ep):
        try:
            await one_turn(ep)  # "3+4=" and 3 new tokens do not fit a context of 6
        except openai.BadRequestError as e:
            raise RuntimeError("the agent gave up") from e

    with pytest.raises(ContextLengthError, match="does not fit the model's context length of 6 tokens"):
        run(rollout(agent_server, lambda _: episode, context_length=6))


def test_an_episode_that_makes_no_request_or_raises_fails_the_run_naming_why(agent_server):
    async def silent(ep):
        return 1.0

    async def buggy(ep):
        await one_turn(ep)
        return {}["reward"]

    with pytest.raises(EpisodeFailed, match=r"workflow.name='mytasks:silent': the episode made no request"):
        run(rollout(agent_server, lambda _: silent, name="mytasks:silent"))
    with pytest.raises(KeyError, match="reward"):
        run(rollout(agent_server, lambda _: buggy))
