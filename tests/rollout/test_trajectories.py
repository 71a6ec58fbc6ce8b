"""From an episode's recorded completions to what the trainer takes (``hpcrl/rollout/proxy/trajectories.py``):
rewards propagated back with the discount, turns joined where a prompt extends the trajectory token for token
and kept apart where it does not, and a completion left without a reward an error, never a silent 0."""

import math

import pytest

from hpcrl.rollout.proxy.records import Completion, EpisodeLog
from hpcrl.rollout.proxy.trajectories import MissingReward, join, propagate_rewards, shared_prompt, to_sample


def made(prompt: list[int], output: list[int], *, id: str = "", version: int = 1, reward=None) -> Completion:
    """A completion whose logprobs tell its tokens apart: -token/10."""
    return Completion(id, 0, 0, prompt, output, [-t / 10 for t in output], [version] * len(output), reward=reward)


def episode(*completions: Completion) -> list[Completion]:
    log = EpisodeLog("key", {})
    for c in completions:
        log.add(c)
    return log.completions


@pytest.mark.parametrize(
    ("given", "final", "expected"),
    [
        ((None, 0.8, None), 1.0, [0.4, 0.8, 1.0]),  # set_reward on the middle one, the final reward returned
        ((None, None, None), 1.0, [0.25, 0.5, 1.0]),  # only the final: halved per completion back
        ((0.3, None, None), 1.0, [0.3, 0.5, 1.0]),  # a reward of its own is kept, not overwritten
        ((None, None, 0.6), None, [0.15, 0.3, 0.6]),  # the last set with set_reward, nothing returned
        ((None, 0.0, None), 1.0, [0.0, 0.0, 1.0]),  # 0 is a reward: it propagates as 0, not as missing
    ],
)
def test_rewards_propagate_back_with_the_discount(given, final, expected):
    completions = episode(*(made([1], [2], id=f"c{i}", reward=r) for i, r in enumerate(given)))
    propagate_rewards(completions, final, 0.5)
    assert [c.reward for c in completions] == pytest.approx(expected, abs=0)


def test_a_discount_of_one_gives_every_earlier_completion_the_reward():
    completions = episode(made([1], [2]), made([1], [3]))
    propagate_rewards(completions, 0.7, 1.0)
    assert [c.reward for c in completions] == [0.7, 0.7]


def test_a_completion_left_without_a_reward_is_missing_reward_not_zero():
    completions = episode(
        made([1], [2], id="first", reward=1.0), made([1], [3], id="second"), made([1], [4], id="third")
    )
    with pytest.raises(MissingReward, match=r"2 of 3 completions have no reward \(the first: 'second'\)"):
        propagate_rewards(completions, None, 0.5)
    assert completions[1].reward is None and completions[2].reward is None


def test_the_three_turns_of_a_conversation_join_into_one_trajectory_masked_on_the_models_tokens():
    a = made([10, 11], [20, 21], version=1, reward=0.25)
    b = made([10, 11, 20, 21, 12], [22], version=2, reward=0.5)  # + a tool result
    c = made([10, 11, 20, 21, 12, 22, 13, 14], [23, 24], version=3, reward=1.0)  # + a user turn
    [t] = join(episode(a, b, c))
    assert t.tokens == c.prompt_ids + c.output_ids
    assert t.mask == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    assert t.logprobs == [0.0, 0.0, -2.0, -2.1, 0.0, -2.2, 0.0, 0.0, -2.3, -2.4]
    assert t.versions == [-1, -1, 1, 1, -1, 2, -1, -1, 3, 3]
    assert t.completions == [a, b, c]
    sample = to_sample(t, len(shared_prompt([t])))
    assert shared_prompt([t]) == [10, 11] and sample.output_ids == t.tokens[2:] and sample.loss_mask == t.mask[2:]
    assert (sample.reward, sample.reward_error, sample.turns) == (1.0, None, 3), "the last completion's reward"


def test_a_turn_whose_prompt_rewrites_an_earlier_turn_starts_a_trajectory_of_its_own():
    a = made([10, 11], [20, 1], reward=0.5)  # the model ended its turn with 1 (end of sequence) ...
    b = made([10, 11, 20, 12], [22], reward=1.0)  # ... which the template did not write back
    first, second = join(episode(a, b))
    assert (first.tokens, first.mask) == ([10, 11, 20, 1], [0, 0, 1, 1])
    assert (second.tokens, second.mask) == ([10, 11, 20, 12, 22], [0, 0, 0, 0, 1]), "its whole prompt masked"
    prompt = shared_prompt([first, second])
    assert prompt == [10, 11]
    samples = [to_sample(t, len(prompt)) for t in (first, second)]
    assert [(s.output_ids, s.loss_mask, s.reward) for s in samples] == [
        ([20, 1], [1, 1], 0.5),
        ([20, 12, 22], [0, 0, 1], 1.0),
    ]


def test_a_turn_extends_the_longest_trajectory_it_continues_in_the_order_they_were_made():
    a = made([10], [20])  # two choices of one request: the first's turn is a prefix of the second's
    b = made([10], [20, 12, 22])
    c = made([5], [21])  # another conversation
    d = made([10, 20, 12, 22, 13], [23])  # continues both a's and b's: b's, the longer, which it really extends
    completions = episode(a, b, c, d)
    ts = join([d, c, b, a])  # joined by the order they were made, not as listed
    assert [t.completions for t in ts] == [[a], [b, d], [c]] and completions[3].order == 3
    assert ts[1].tokens == [10, 20, 12, 22, 13, 23] and ts[1].mask == [0, 1, 1, 1, 0, 1]
    assert shared_prompt(ts) == [], "no token is common to all three"
    assert shared_prompt(ts[:2]) == [10]


def test_a_failed_reward_marks_the_sample_failed_without_a_value():
    [t] = join(episode(made([1], [2], reward=1.0)))
    sample = to_sample(t, 1, error="1 of 1 completions have no reward")
    assert (sample.reward, sample.reward_error) == (None, "1 of 1 completions have no reward")


def test_set_reward_names_a_response_and_optionally_one_choice():
    log = EpisodeLog("key", {})
    for i in range(2):
        c = made([1], [2 + i], id="chatcmpl-a")
        c.index = i
        log.add(c)
    log.add(made([1], [4], id="chatcmpl-b"))
    log.set_reward("chatcmpl-a", 1)
    log.set_reward("chatcmpl-b", True)  # rewards are numbers: a bool counts as 1.0, as reward functions' do
    assert [c.reward for c in log.completions] == [1.0, 1.0, 1.0]
    log.set_reward("chatcmpl-a", 0.25, index=1)
    assert [c.reward for c in log.completions] == [1.0, 0.25, 1.0]


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (("chatcmpl-x", 1.0), "no completion 'chatcmpl-x' in this episode; its completions are ['chatcmpl-a']"),
        (("chatcmpl-a", 1.0, 3), "no completion 'chatcmpl-a' with index 3"),
        (("chatcmpl-a", math.nan), "set_reward('chatcmpl-a', nan)"),
        (("chatcmpl-a", "1.0"), "set_reward('chatcmpl-a', '1.0')"),
    ],
)
def test_set_reward_refuses_an_unknown_completion_or_a_value_that_is_not_a_number(call, words):
    log = EpisodeLog("key", {})
    log.add(made([1], [2], id="chatcmpl-a"))
    with pytest.raises(ValueError) as refused:
        log.set_reward(*call)
    assert words in str(refused.value)
    assert log.completions[0].reward is None
