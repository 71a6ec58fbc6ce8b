"""From one episode's completions to trajectories the trainer takes: rewards propagated, turns joined.

Rewards. The episode gives rewards with ``set_reward`` and, by returning a number, to its last completion. Then,
from the last completion back to the first, each completion without a reward of its own gets ``turn_discount``
times the reward of the completion made after it: a conversation's earlier turns share its outcome, the earlier
the less. A completion left without one (none was given after it) is an error of the episode.

Joining. Completions are taken in the order they were made. One whose prompt starts, token for token, with
everything a trajectory holds so far (its prompt, the model's turns and what came between) extends that
trajectory (the longest such one): the tokens its prompt adds (a tool result, a user turn, the template's
markers) go in with loss mask 0, logprob 0.0 and version -1, then its output with mask 1. Any other starts a
trajectory of its own, its whole prompt masked. So a trajectory is exactly the token sequence the model was
conditioned on, turn after turn, and nothing is re-tokenised; a template that renders an earlier turn otherwise
than the model wrote it (another tokenisation, a thinking block dropped, an end-of-turn token the model did not
emit) splits the conversation into separate trajectories instead, each trained on the context it really had.

A trajectory's reward is the reward of its last completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hpcrl.rollout.proxy.records import Completion
from hpcrl.rollout.workflows.base import Sample, joined_logprobs


class MissingReward(ValueError):
    """A completion has no reward: neither given nor propagated from a later one."""


def propagate_rewards(completions: Sequence[Completion], final: float | None, discount: float) -> None:
    """Give ``final`` (if not None) to the last completion, then discount rewards back (module docstring), in place."""
    if not completions:
        return
    if final is not None:
        completions[-1].reward = final
    after: float | None = None
    for c in reversed(completions):
        if c.reward is None and after is not None:
            c.reward = discount * after
        after = c.reward
    missing = [c for c in completions if c.reward is None]
    if missing:
        raise MissingReward(
            f"{len(missing)} of {len(completions)} completions have no reward (the first: {missing[0].id!r}): "
            "return the reward of the last completion, or set_reward() one made after them"
        )


@dataclass
class Trajectory:
    """Token by token: what the model was conditioned on and what it generated, in order."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 where the model sampled the token
    logprobs: list[float] | None = field(default_factory=list)  # None once a completion has none
    versions: list[int] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)

    def append(self, ids: Sequence[int], sampled: Completion | None = None) -> None:
        """``ids`` the model did not sample (``sampled`` None), or ``sampled``'s output."""
        n = len(ids)
        self.tokens += ids
        if sampled is None:
            self.mask += [0] * n
            self.logprobs = joined_logprobs(self.logprobs, [0.0] * n)
            self.versions += [-1] * n
        else:
            self.mask += [1] * n
            self.logprobs = joined_logprobs(self.logprobs, sampled.logprobs)
            self.versions += sampled.versions
            self.completions.append(sampled)


def join(completions: Sequence[Completion]) -> list[Trajectory]:
    """The trajectories of an episode's completions (module docstring), in the order they were started."""
    trajectories: list[Trajectory] = []
    for c in sorted(completions, key=lambda c: c.order):
        extended = [t for t in trajectories if c.prompt_ids[: len(t.tokens)] == t.tokens]
        if extended:
            t = max(extended, key=lambda t: len(t.tokens))
            t.append(c.prompt_ids[len(t.tokens) :])
        else:
            t = Trajectory()
            trajectories.append(t)
            t.append(c.prompt_ids)
        t.append(c.output_ids, sampled=c)
    return trajectories


def shared_prompt(trajectories: Sequence[Trajectory]) -> list[int]:
    """The tokens every trajectory starts with, up to the first the model sampled in any: the group's prompt."""
    if not trajectories:
        return []
    limit = min(t.mask.index(1) if 1 in t.mask else len(t.tokens) for t in trajectories)
    first = trajectories[0].tokens[:limit]
    n = 0
    while n < len(first) and all(t.tokens[n] == first[n] for t in trajectories):
        n += 1
    return first[:n]


def to_sample(t: Trajectory, prompt_len: int, error: str | None = None) -> Sample:
    """The trajectory after the group's prompt, as the trainer takes it; its reward is its last completion's."""
    last = t.completions[-1]
    return Sample(
        output_ids=t.tokens[prompt_len:],
        logprobs=None if t.logprobs is None else t.logprobs[prompt_len:],
        versions=t.versions[prompt_len:],
        finish_reason=last.finish_reason,
        text=last.text,
        reward=None if error is not None else last.reward,
        reward_error=error,
        loss_mask=t.mask[prompt_len:],
        turns=len(t.completions),
    )
