"""A batch's reward statistics: the share of groups that give group advantages nothing to learn from."""

import pytest

from hpcrl.controller.batch import rollout_stats
from hpcrl.rollout.workflows.base import Group, Sample


def group(*rewards: float) -> Group:
    return Group("p", "a", [5], [Sample([6], [-0.1], [0], "stop", reward=r) for r in rewards])


def test_the_zero_std_share_counts_groups_whose_rewards_are_all_equal():
    groups = [group(1.0, 1.0, 1.0), group(0.0, 1.0, 0.0), group(0.0, 0.0, 0.0), group(0.5, 0.5, 0.25)]
    stats = rollout_stats(groups, trainer_version=0)
    assert stats["reward_zero_std_frac"] == pytest.approx(0.5), "the all-1 and the all-0 groups, 2 of 4"
    assert stats["reward_std"] > 0, "the batch's own spread is not the groups'"
    assert rollout_stats([group(0.0, 1.0)], 0)["reward_zero_std_frac"] == 0.0
