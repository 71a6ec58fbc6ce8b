"""Rewards: functions named in config, resolved by import in each reward process, run with a timeout.

``registry`` resolves ``"package.module:function"`` and defines the reward signature; ``pool`` runs
calls in worker processes (``worker`` is their entry point); ``policy`` turns failed calls into dropped
groups, zeros or an error; ``builtin`` holds the rewards hpcrl ships.
"""

from hpcrl.reward.outcome import RewardError, RewardOutcome
from hpcrl.reward.policy import ON_ERROR, apply_failure_policy
from hpcrl.reward.pool import RewardPool, WorkerStartError
from hpcrl.reward.registry import RewardSpecError, resolve, to_reward

__all__ = [
    "ON_ERROR",
    "RewardError",
    "RewardOutcome",
    "RewardPool",
    "RewardSpecError",
    "WorkerStartError",
    "apply_failure_policy",
    "resolve",
    "to_reward",
]
