"""What failed reward calls do to their groups: ``reward.on_error`` = drop | zero | fail.

A group is the ``group_size`` samples of one prompt; GRPO-style advantages compare rewards inside a
group, so one missing reward spoils the whole group:

- ``drop``: a group with any failed call is left out of the batch (``None`` in its place);
- ``zero``: a failed call scores 0.0, as a wrong answer would;
- ``fail``: any failed call raises ``RewardError`` with the first error and how many failed.

Failures are always counted in the metrics and logged, whatever the policy: never silently scored.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hpcrl.reward.outcome import RewardError, RewardOutcome

log = logging.getLogger(__name__)

ON_ERROR = ("drop", "zero", "fail")


def apply_failure_policy(
    groups: Sequence[Sequence[RewardOutcome]], on_error: str
) -> tuple[list[list[float] | None], dict[str, int]]:
    """Rewards per group (``None`` for a dropped group) and ``reward_errors``/``reward_timeouts``/``groups_dropped``."""
    if on_error not in ON_ERROR:
        raise ValueError(f"reward.on_error={on_error!r} is invalid: expected one of {', '.join(ON_ERROR)}")
    failed = [o for group in groups for o in group if not o.ok]
    metrics = {
        "reward_errors": len(failed),
        "reward_timeouts": sum(o.timed_out for o in failed),
        "groups_dropped": 0,
    }
    if failed:
        total = sum(len(group) for group in groups)
        summary = f"{len(failed)} of {total} reward calls failed ({metrics['reward_timeouts']} timed out)"
        if on_error == "fail":
            raise RewardError(f"{summary} and reward.on_error=fail; the first error: {failed[0].error}")
        log.warning("%s; reward.on_error=%s; the first error: %s", summary, on_error, failed[0].error)
    rewards: list[list[float] | None] = []
    for group in groups:
        if on_error == "drop" and not all(o.ok for o in group):
            metrics["groups_dropped"] += 1
            rewards.append(None)
        else:
            rewards.append([o.value if o.value is not None else 0.0 for o in group])
    return rewards, metrics
