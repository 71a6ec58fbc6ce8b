import math

import numpy as np
import pytest

from hpcrl.reward.builtin import mod10
from hpcrl.reward.registry import RewardSpecError, resolve, to_reward
from tests.reward import fixtures


def test_resolves_a_function_by_import():
    assert resolve("hpcrl.reward.builtin:mod10") is mod10
    assert resolve("tests.reward.fixtures:behave") is fixtures.behave


@pytest.mark.parametrize("spec", ["hpcrl.reward.builtin", "a:b:c", "hpcrl.reward.builtin:", ":mod10", "a b:c", ""])
def test_a_malformed_spec_says_the_expected_form(spec):
    with pytest.raises(RewardSpecError, match=r"'package\.module:function'") as e:
        resolve(spec)
    assert repr(spec) in str(e.value)


def test_a_missing_module_shows_the_import_error():
    with pytest.raises(RewardSpecError) as e:
        resolve("tests.reward.no_such_module:fn")
    message = str(e.value)
    assert "'tests.reward.no_such_module:fn'" in message
    assert "cannot import module 'tests.reward.no_such_module'" in message
    assert "ModuleNotFoundError: No module named 'tests.reward.no_such_module'" in message


def test_a_module_that_fails_on_import_shows_its_error():
    with pytest.raises(RewardSpecError, match="RuntimeError: broken on purpose"):
        resolve("tests.reward.broken:fn")


def test_a_missing_attribute_lists_what_the_module_has():
    with pytest.raises(RewardSpecError) as e:
        resolve("tests.reward.fixtures:nope")
    message = str(e.value)
    assert "has no attribute 'nope'" in message
    assert "behave" in message and "worker_pid" in message


def test_an_attribute_that_is_not_callable():
    with pytest.raises(RewardSpecError, match=r"fixtures.NOT_CALLABLE is a int, not a callable"):
        resolve("tests.reward.fixtures:NOT_CALLABLE")


@pytest.mark.parametrize("module", ["__main__", "__mp_main__"])
def test_a_function_in_main_is_refused(module):
    with pytest.raises(RewardSpecError, match="cannot be imported by the reward processes"):
        resolve(f"{module}:fn")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.25, 0.25), (True, 1.0), (False, 0.0), (3, 3.0), (np.float32(0.5), 0.5), (np.int64(2), 2.0), (np.True_, 1.0)],
)
def test_to_reward_accepts_numbers(value, expected):
    reward = to_reward(value)
    assert type(reward) is float and reward == expected


@pytest.mark.parametrize(("value", "error"), [("1", TypeError), (None, TypeError), ([1.0], TypeError)])
def test_to_reward_refuses_other_types(value, error):
    with pytest.raises(error, match=f"returned {type(value).__name__}.*a reward must be a float, int or bool"):
        to_reward(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_to_reward_refuses_nan_and_infinities(value):
    with pytest.raises(ValueError, match="must be a finite number"):
        to_reward(value)
