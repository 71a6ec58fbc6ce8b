"""The reward pool with real worker processes."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from hpcrl.reward.pool import RewardPool, WorkerStartError
from hpcrl.reward.registry import RewardSpecError
from tests.conftest import REPO

BEHAVE = "tests.reward.fixtures:behave"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _items(*completions: str, answer: str = "a") -> list[tuple[str, str, str]]:
    return [("prompt", c, answer) for c in completions]


def test_scores_every_item_in_order():
    completions = ["a" if i % 3 else "b" for i in range(200)]
    with RewardPool(BEHAVE, workers=2, timeout_s=10) as pool:
        outcomes = asyncio.run(pool.score(_items(*completions)))
        assert asyncio.run(pool.score([])) == []
    assert [o.value for o in outcomes] == [1.0 if c == "a" else 0.0 for c in completions]
    assert all(o.ok and o.error is None for o in outcomes)


def test_rewards_run_in_the_workers_resolved_by_import():
    # The function lives in a test module: the workers can only have it by importing that module.
    with RewardPool("tests.reward.fixtures:worker_pid", workers=2, timeout_s=10) as pool:
        pids = {int(o.value) for o in pool.score_sync(_items(*["x"] * 64))}
        assert pids <= set(pool.pids()) and os.getpid() not in pids
        assert len(pool.pids()) == 2


def test_a_reward_marked_in_process_is_scored_here_with_no_worker_process():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with RewardPool("tests.reward.fixtures:here_pid", workers=2, timeout_s=10) as pool:
        outcomes = pool.score_sync(_items("x", "raise", "y"))
        assert [o.value for o in asyncio.run(pool.score(_items("z")))] == [os.getpid()]
        assert pool.pids() == [] and {p.pid for p in psutil.Process().children(recursive=True)} == before
        with pytest.raises(TypeError, match=r"items\[0\] must be \(prompt, completion, answer\) strings"):
            pool.score_sync([("only", "two")])
    assert [o.value for o in outcomes] == [os.getpid(), None, os.getpid()]
    assert outcomes[1].error == "raised ValueError: cannot score answer 'a'", "a raise fails its item, as in a worker"
    with pytest.raises(RuntimeError, match="needs a started, open pool"):
        pool.score_sync(_items("x"))


def test_the_builtin_mod10_is_marked_in_process_and_math_verify_is_not():
    from hpcrl.reward.builtin import math_verify_reward, mod10
    from hpcrl.reward.registry import runs_in_process

    assert runs_in_process(mod10) and not runs_in_process(math_verify_reward)


def test_a_raising_reward_fails_only_its_item_with_the_exception_text():
    with RewardPool(BEHAVE, workers=1, timeout_s=10) as pool:
        pid = pool.pids()[0]
        outcomes = pool.score_sync(_items("a", "raise", "exit", "a"))
        assert pool.pids() == [pid]  # the worker lived on
    assert [o.value for o in outcomes] == [1.0, None, None, 1.0]
    assert outcomes[1].error == "raised ValueError: cannot score answer 'a'"
    assert outcomes[2].error == "raised SystemExit: 4"
    assert not outcomes[1].timed_out


def test_bad_return_values_are_errors():
    with RewardPool("tests.reward.fixtures:returns", workers=1, timeout_s=10) as pool:
        outcomes = pool.score_sync(_items("true", "str", "nan", "inf", "none"))
    assert outcomes[0].value == 1.0
    assert outcomes[1].error == "returned str 'yes'; a reward must be a float, int or bool"
    assert "returned nan" in outcomes[2].error and "returned inf" in outcomes[3].error
    assert "returned NoneType" in outcomes[4].error


def test_a_reward_writing_to_stdout_cannot_corrupt_the_wire():
    with RewardPool("tests.reward.fixtures:noisy", workers=1, timeout_s=10) as pool:
        assert [o.value for o in pool.score_sync(_items("x", "y"))] == [0.5, 0.5]


@pytest.mark.timeout(60)
def test_a_hanging_reward_times_out_and_its_worker_is_replaced():
    with RewardPool(BEHAVE, workers=1, timeout_s=1.0) as pool:
        hung = pool.pids()[0]
        start = time.monotonic()
        outcomes = pool.score_sync(_items("a", "hang", "a", "b"))
        elapsed = time.monotonic() - start
        assert [o.value for o in outcomes] == [1.0, None, 1.0, 0.0]
        assert outcomes[1].timed_out and outcomes[1].error.startswith("timed out after 1 s")
        assert elapsed < 30  # it did not wait for the 60 s sleep
        assert _gone(hung) and pool.restarts == 1
        (replacement,) = pool.pids()
        assert replacement != hung
        assert [o.value for o in pool.score_sync(_items("a", "b"))] == [1.0, 0.0]


@pytest.mark.timeout(60)
def test_other_workers_carry_on_while_one_hangs():
    with RewardPool(BEHAVE, workers=2, timeout_s=2.0, max_batch=1) as pool:
        outcomes = pool.score_sync(_items("hang", *["a"] * 50))
    assert outcomes[0].timed_out
    assert all(o.value == 1.0 for o in outcomes[1:])


def test_a_reward_that_exits_the_process_fails_only_its_item():
    with RewardPool(BEHAVE, workers=1, timeout_s=10) as pool:
        dead = pool.pids()[0]
        outcomes = pool.score_sync(_items("a", "die", "a"))
        assert [o.value for o in outcomes] == [1.0, None, 1.0]
        assert f"(pid {dead}) exited with code 3 while scoring this item" in outcomes[1].error
        assert not outcomes[1].timed_out
        assert pool.pids() != [dead] and pool.restarts == 1


@pytest.mark.timeout(60)
def test_a_worker_killed_mid_task_fails_its_item_and_is_replaced():
    with RewardPool(BEHAVE, workers=1, timeout_s=30) as pool:
        victim = pool.pids()[0]
        threading.Timer(0.5, lambda: psutil.Process(victim).kill()).start()
        outcomes = pool.score_sync(_items("sleep:5", "a"))
        assert outcomes[0].error == f"reward worker (pid {victim}) was killed by SIGKILL while scoring this item"
        assert outcomes[1].value == 1.0
        assert pool.pids() != [victim]


def test_close_leaves_no_worker_process():
    pool = RewardPool(BEHAVE, workers=3, timeout_s=10).start()
    pids = pool.pids()
    assert len(pids) == 3 and all(psutil.Process(p).ppid() == os.getpid() for p in pids)
    pool.score_sync(_items("a", "b"))
    pool.close()
    assert all(_gone(p) for p in pids)
    assert pool.pids() == []
    pool.close()  # idempotent


@pytest.mark.timeout(60)
def test_close_during_a_hang_fails_the_pending_items_at_once():
    pool = RewardPool(BEHAVE, workers=1, timeout_s=60).start()
    pid = pool.pids()[0]
    threading.Timer(0.5, pool.close).start()
    start = time.monotonic()
    outcomes = pool.score_sync(_items("hang", "a"))
    assert time.monotonic() - start < 30
    assert all("closed" in o.error for o in outcomes)
    assert _gone(pid)
    with pytest.raises(RuntimeError, match="needs a started, open pool"):
        pool.score_sync(_items("a"))


def test_the_event_loop_is_not_blocked_while_rewards_run():
    async def main(pool):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        outcomes = await pool.score(_items("sleep:0.5", "sleep:0.5"))
        task.cancel()
        return outcomes, ticks

    with RewardPool(BEHAVE, workers=2, timeout_s=10) as pool:
        outcomes, ticks = asyncio.run(main(pool))
    assert [o.value for o in outcomes] == [0.0, 0.0]
    assert ticks >= 10


def test_a_bad_spec_fails_before_any_worker_starts():
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(RewardSpecError, match="ModuleNotFoundError"):
        RewardPool("tests.reward.no_such_module:fn", workers=2, timeout_s=1)
    with pytest.raises(RewardSpecError, match="has no attribute 'nope'"):
        RewardPool("tests.reward.fixtures:nope", workers=2, timeout_s=1)
    assert {p.pid for p in psutil.Process().children()} == before


def test_a_spec_the_workers_cannot_import_fails_the_start(monkeypatch, tmp_path):
    # Importable here (on our sys.path) but not in the workers: their PYTHONPATH is our sys.path at
    # start time, so take the directory off sys.path after the parent has resolved the spec.
    (tmp_path / "parent_only_reward.py").write_text("def fn(p, c, a):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = RewardPool("parent_only_reward:fn", workers=1, timeout_s=1)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p != str(tmp_path)])
    with pytest.raises(WorkerStartError, match="ModuleNotFoundError: No module named 'parent_only_reward'"):
        pool.start()
    assert pool.pids() == []


@pytest.mark.parametrize("item", [("p", "c"), ("p", "c", 3), "pca"])
def test_items_must_be_three_strings(item):
    with RewardPool(BEHAVE, workers=1, timeout_s=10) as pool, pytest.raises(TypeError, match=r"items\[1\]"):
        pool.score_sync([("p", "c", "a"), item])


def test_score_needs_a_started_pool():
    with pytest.raises(RuntimeError, match="needs a started, open pool"):
        RewardPool(BEHAVE, workers=1, timeout_s=1).score_sync(_items("a"))


@pytest.mark.timeout(120)
def test_math_verify_reward_in_a_worker():
    # the worker calls it in its main thread, where math-verify's SIGALRM timeouts work
    with RewardPool("hpcrl.reward.builtin:math_verify_reward", workers=1, timeout_s=30) as pool:
        outcomes = pool.score_sync([("q", "so \\boxed{\\frac{1}{2}}", "0.5"), ("q", "#### 41", "42")])
    assert [o.value for o in outcomes] == [1.0, 0.0]


def test_a_worker_that_died_while_idle_is_replaced_without_failing_an_item():
    with RewardPool(BEHAVE, workers=1, timeout_s=10) as pool:
        idle = pool.pids()[0]
        psutil.Process(idle).kill()
        psutil.Process(idle).wait(5)
        assert [o.value for o in pool.score_sync(_items("a", "b"))] == [1.0, 0.0]
        assert pool.pids() != [idle] and pool.restarts == 1


@pytest.mark.timeout(60)
def test_a_worker_outlives_its_killed_parent_by_a_second_at_most():
    # The parent is SIGKILLed (no cleanup runs) while its worker is stuck in a 60 s reward.
    script = (
        "from hpcrl.reward.pool import RewardPool\n"
        f"pool = RewardPool({BEHAVE!r}, workers=1, timeout_s=120).start()\n"
        "print(pool.pids()[0], flush=True)\n"
        "pool.score_sync([('p', 'hang', 'a')])\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.3)  # let it take the item
        parent.kill()
        parent.wait()
        worker.wait(10)  # its watchdog sees the new parent and exits
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_a_worker_ignores_slurms_warning_signal():
    """Slurm sends SIGUSR2 (--signal=USR2@N) to every process of the step; only the controller acts on it."""
    with RewardPool(BEHAVE, workers=1, timeout_s=10) as pool:
        worker = pool.pids()[0]
        os.kill(worker, signal.SIGUSR2)
        time.sleep(0.5)
        assert psutil.Process(worker).is_running() and pool.pids() == [worker]
        assert [o.value for o in pool.score_sync(_items("a"))] == [1.0] and pool.restarts == 0


def test_a_reward_takes_the_row_columns_it_names_by_name():
    items = [("p", "5", "a", {"low": 1, "high": 9, "unused": [1, 2]}), ("p", "10", "a", {"low": 1, "high": 9})]
    with RewardPool("tests.reward.fixtures:in_range", workers=1, timeout_s=10) as pool:
        outcomes = pool.score_sync([*items, ("p", "5", "a", {"low": 1})])
    assert [o.value for o in outcomes] == [1.0, 0.0, None]
    assert outcomes[2].error == "raised TypeError: in_range() missing 1 required positional argument: 'high'"
    assert [o.parts for o in outcomes] == [None] * 3, "a single reward.fn has no parts"


def test_a_reward_with_kwargs_gets_every_column_and_the_names_it_does_not_take():
    with RewardPool("tests.reward.fixtures:level_and_names", workers=1, timeout_s=10) as pool:
        [outcome] = pool.score_sync([("p", "c", "a", {"level": 3})])
    assert outcome.value == 33.0  # level 3, and prompt, answer, level in **row


def test_a_weighted_list_scores_each_function_and_keeps_each_part_by_name():
    specs = ["tests.reward.fixtures:behave", "tests.reward.fixtures:in_range"]
    with RewardPool(specs, workers=2, timeout_s=10, weights=[0.5, 2.0]) as pool:
        outcomes = pool.score_sync(
            [("p", "5", "5", {"low": 1, "high": 9}), ("p", "12", "5", {"low": 1, "high": 20}), ("p", "raise", "5", {})]
        )
    assert [(o.value, o.parts) for o in outcomes[:2]] == [
        (2.5, {"behave": 1.0, "in_range": 1.0}),
        (2.0, {"behave": 0.0, "in_range": 1.0}),
    ]
    assert outcomes[2].value is None and outcomes[2].error == "behave: raised ValueError: cannot score answer '5'"


def test_a_list_of_functions_marked_in_process_is_scored_here():
    specs = ["tests.reward.fixtures:here_length", "tests.reward.fixtures:here_answer_is_digit"]
    with RewardPool(specs, workers=2, timeout_s=10) as pool:
        assert pool.pids() == []
        outcomes = pool.score_sync([("p", "abc", "7"), ("p", "abcd", "x")])
    assert [(o.value, o.parts) for o in outcomes] == [
        (4.0, {"here_length": 3.0, "here_answer_is_digit": 1.0}),
        (4.0, {"here_length": 4.0, "here_answer_is_digit": 0.0}),
    ]


@pytest.mark.parametrize(
    ("spec", "weights", "error"),
    [
        (["tests.reward.fixtures:behave", "tests.reward.other_fixtures:behave"], (), "two are called 'behave'"),
        (["tests.reward.fixtures:behave", "hpcrl.reward.builtin:mod10"], [1.0], "one finite number per function"),
        ("tests.reward.fixtures:positional", (), "takes prompt, completion, answer by position only"),
        ([], (), "the list is empty"),
    ],
)
def test_a_list_that_cannot_be_scored_fails_before_any_worker_starts(spec, weights, error):
    with pytest.raises(RewardSpecError, match=error):
        RewardPool(spec, workers=1, weights=weights)
