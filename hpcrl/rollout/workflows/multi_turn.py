"""Multi-turn RLVR: the model answers, a wrong answer earns a feedback turn, and the model tries again.

    prompt_ids -generate-> out1 -reward-> wrong? -> + feedback_ids -generate-> out2 -reward-> ... -> Sample

A trajectory is one token list that grows turn by turn, ``prompt_ids + out1 + feedback_ids + out2 ...``,
and every turn is generated from that list of ids. The history is never decoded and re-tokenised:
re-tokenising can merge or split tokens at turn boundaries, and the model would then be trained on
tokens other than those it was conditioned on. A trajectory ends after a turn the reward scores 1
(right), after ``max_turns`` model turns, or when the reward call fails (its error becomes the sample's).

What the trainer gets (``Sample``): every token after the prompt, with loss mask 1 on the model's
tokens and 0 on the feedback's, whose logprobs are 0.0 (None for the whole sample when the servers were asked for
none) and versions -1 (nobody sampled them); the text
of the last model turn, which is what the reward read; and that turn's reward times
``turn_discount ** (turns - 1)``, so a right answer is worth more the sooner it comes.

Each turn is ``SingleTurn.sample``: a weight update's abort is waited out and the turn resubmitted from
where it stopped (the history plus its partial tokens) with the rest of its ``max_new_tokens``; a server that
aborts every request fails the turn after ``max_empty_aborts`` tries with no new token (``NoProgress``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from hpcrl.inference.client import InferenceClient
from hpcrl.rollout.workflows.base import Group, Rewarder, Sample, derive_seed, joined_logprobs
from hpcrl.rollout.workflows.single_turn import MAX_EMPTY_ABORTS, SingleTurn

log = logging.getLogger(__name__)

# A finished exchange to render the feedback turn after (see feedback_text); its content is irrelevant.
_BEFORE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


def feedback_text(tokenizer: Any, feedback: str) -> str:
    """The text put between two model turns: ``feedback`` as a chat user turn, or as it is without a template.

    With a chat template this is what the template adds to a conversation that ends with an assistant
    turn when one more user turn and the generation prompt follow (``user: FEEDBACK\\nassistant: `` for
    the tiny model's template). Rendering the user turn on its own would also bring what a template
    puts at the start of every conversation, such as Qwen's default system prompt. The assistant turn's
    own end (its end-of-turn token) is not repeated: it is the model's, ending its turn as eos.
    """
    if not getattr(tokenizer, "chat_template", None):
        return feedback
    before = tokenizer.apply_chat_template(_BEFORE, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*_BEFORE, {"role": "user", "content": feedback}], add_generation_prompt=True, tokenize=False
    )
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders earlier turns differently once a user turn follows, so the feedback "
            f"turn cannot be appended as tokens: {before!r} is not a prefix of {after!r}. Use a tokenizer "
            "without a chat template (the feedback is then appended as plain text)"
        )
    return after[len(before) :]


def feedback_ids(tokenizer: Any, feedback: str) -> list[int]:
    """The feedback turn's tokens; warns when they do not spell it (a tiny model's alphabet lacks some)."""
    text = feedback_text(tokenizer, feedback)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    spelt = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if spelt != text:  # an unknown character may come back as <unk>, or not at all
        log.warning("the feedback turn %r is tokenised as %r: the model will see the latter", text, spelt)
    return ids


class MultiTurn:
    """Sample ``group_size`` multi-turn trajectories of one prompt, each scored after every turn."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        sampling: dict[str, Any],  # every turn's sampling parameters; max_new_tokens is per turn
        group_size: int,
        rewards: Rewarder,
        resumed: asyncio.Event,  # set while generation runs; cleared during a weight update
        *,
        max_turns: int,  # the most model turns in one trajectory
        turn_discount: float,  # the reward's factor per turn after the first
        feedback: str,  # the user turn after a wrong answer
        max_empty_aborts: int = MAX_EMPTY_ABORTS,  # a turn's aborted answers in a row with no token, unpaused, fail it
        logprobs: bool = True,  # ask the servers for the sampled tokens' logprobs; False: samples carry None
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0 < turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        # generates one turn from a history of ids (its own reward and group size go unused)
        self.turn = SingleTurn(
            client, tokenizer, sampling, 1, rewards, resumed, max_empty_aborts=max_empty_aborts, logprobs=logprobs
        )
        self.tokenizer, self.group_size, self.rewards = tokenizer, group_size, rewards
        self.max_turns, self.turn_discount = max_turns, turn_discount
        self.feedback_ids = tuple(feedback_ids(tokenizer, feedback))  # shared by episodes, so immutable

    async def run(
        self, prompt: str, answer: str, seed: int | None = None, columns: Mapping[str, Any] | None = None
    ) -> Group:
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        group = Group(prompt, answer, prompt_ids)
        trajectories = (
            self.trajectory(prompt, answer, prompt_ids, derive_seed(seed, "sample", i), columns)
            for i in range(self.group_size)
        )
        group.samples = list(await asyncio.gather(*trajectories))
        return group

    async def trajectory(
        self,
        prompt: str,
        answer: str,
        prompt_ids: list[int],
        seed: int | None = None,
        columns: Mapping[str, Any] | None = None,
    ) -> Sample:
        """Turns until a right answer, the turn limit or a failed reward; the sample holds them all (its reward parts
        are the last turn's, not discounted)."""
        out: list[int] = []
        logprobs: list[float] | None = []
        versions: list[int] = []
        mask: list[int] = []
        for turns in range(1, self.max_turns + 1):
            if turns > 1:  # the last answer was wrong: the feedback turn, which nobody sampled
                n = len(self.feedback_ids)
                out += self.feedback_ids
                logprobs = joined_logprobs(logprobs, [0.0] * n)
                versions += [-1] * n
                mask += [0] * n
            turn = await self.turn.sample(prompt_ids + out, derive_seed(seed, "turn", turns))
            out += turn.output_ids
            logprobs = joined_logprobs(logprobs, turn.logprobs)
            versions += turn.versions
            mask += [1] * len(turn.output_ids)
            [outcome] = await self.rewards.score([(prompt, turn.text, answer, columns or {})])
            if outcome.error is not None or outcome.value >= 1:
                break
        reward = None if outcome.value is None else outcome.value * self.turn_discount ** (turns - 1)
        return Sample(
            out, logprobs, versions, turn.finish_reason, turn.text, reward, outcome.error, mask, turns, outcome.parts
        )
