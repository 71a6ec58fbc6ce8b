import pytest

from hpcrl.reward.outcome import RewardError, RewardOutcome
from hpcrl.reward.policy import apply_failure_policy

OK1, OK0 = RewardOutcome(value=1.0), RewardOutcome(value=0.0)
RAISED = RewardOutcome(error="raised ValueError: bad")
TIMED_OUT = RewardOutcome(error="timed out after 2 s", timed_out=True)
GROUPS = [[OK1, OK0], [OK1, RAISED], [TIMED_OUT, OK0], [OK0, OK0]]


def test_drop_leaves_out_every_group_with_a_failure():
    rewards, metrics = apply_failure_policy(GROUPS, "drop")
    assert rewards == [[1.0, 0.0], None, None, [0.0, 0.0]]
    assert metrics == {"reward_errors": 2, "reward_timeouts": 1, "groups_dropped": 2}


def test_zero_scores_failures_as_zero_and_counts_them():
    rewards, metrics = apply_failure_policy(GROUPS, "zero")
    assert rewards == [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    assert metrics == {"reward_errors": 2, "reward_timeouts": 1, "groups_dropped": 0}


def test_fail_raises_with_the_first_error_and_the_count():
    with pytest.raises(RewardError, match=r"2 of 8 reward calls failed \(1 timed out\).*raised ValueError: bad"):
        apply_failure_policy(GROUPS, "fail")


@pytest.mark.parametrize("on_error", ["drop", "zero", "fail"])
def test_no_failures_means_every_reward_and_zero_counts(on_error):
    rewards, metrics = apply_failure_policy([[OK1, OK0], [OK0]], on_error)
    assert rewards == [[1.0, 0.0], [0.0]]
    assert metrics == {"reward_errors": 0, "reward_timeouts": 0, "groups_dropped": 0}


def test_failures_are_logged(caplog):
    apply_failure_policy(GROUPS, "zero")
    assert "2 of 8 reward calls failed" in caplog.text and "raised ValueError: bad" in caplog.text


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match=r"reward\.on_error='skip' is invalid: expected one of drop, zero, fail"):
        apply_failure_policy(GROUPS, "skip")
