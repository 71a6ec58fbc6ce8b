"""Model rewards (``async def f(..., reward_model)``): resolved and refused by the registry, scored by the pool in its
event loop against a fake reward-model server (a group in one batched request, beside ordinary functions of a list),
their timeouts and exceptions counted as failed rewards; llm_judge's template and answer parsing; the preflight
checks of a run that names one."""

import asyncio

import pytest

from hpcrl.config import ConfigError
from hpcrl.config.preflight import preflight
from hpcrl.config.schema import Config, JudgeConfig
from hpcrl.reward.judge import llm_judge, score_answer, template_columns
from hpcrl.reward.model_client import RewardModel
from hpcrl.reward.policy import apply_failure_policy
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.registry import RewardFns, RewardSpecError, resolve_reward
from tests.config.test_options import one_error_line
from tests.conftest import run_main
from tests.inference.test_client_fakes import run
from tests.reward.fake_reward_model import fake_reward_models

JUDGED = "tests.reward.model_fixtures:judged"
MISBEHAVES = "tests.reward.model_fixtures:misbehaves"
GROUP = [("1+1=", "2ok", "2"), ("1+1=", "3", "2"), ("1+1=", "2 ok", "2"), ("1+1=", "", "2")]


def score(pool: RewardPool, items, servers: int = 1):
    """``pool.score(items)`` in a loop of its own, given fake reward-model servers; (outcomes, their bodies)."""

    async def drive():
        async with fake_reward_models(servers) as fakes:
            pool.use_reward_model([f.address for f in fakes])
            outcomes = await pool.score(items)
            return outcomes, [body for fake in fakes for body in fake.bodies]

    return run(drive())


def test_a_model_reward_is_resolved_with_reward_model_taken_for_no_column():
    fns = RewardFns.resolve(["tests.reward.model_fixtures:needs_column", "tests.reward.fixtures:in_range"])
    assert [r.uses_reward_model for r in fns.rewards] == [True, False]
    assert fns.needs() == {
        "level": "the parameter 'level' of reward function 'tests.reward.model_fixtures:needs_column'",
        "low": "the parameter 'low' of reward function 'tests.reward.fixtures:in_range'",
        "high": "the parameter 'high' of reward function 'tests.reward.fixtures:in_range'",
    }
    assert fns.columns() == ("level", "low", "high") and fns.model_rewards == [fns.rewards[0]]
    with pytest.raises(RewardSpecError, match="is an async def without a 'reward_model' parameter"):
        resolve_reward("tests.reward.model_fixtures:no_model")
    with pytest.raises(RewardSpecError, match="takes 'reward_model' but is not an async def"):
        resolve_reward("tests.reward.model_fixtures:sync_model")


def test_a_group_is_scored_in_one_batched_request_and_weighed_with_ordinary_functions():
    """A worker-process function, an @in_process one and a model reward in one list: each value kept, weighed."""
    specs = ["tests.reward.fixtures:behave", JUDGED, "tests.reward.fixtures:here_pid"]
    with RewardPool(specs, workers=1, timeout_s=5, weights=[1.0, 10.0, 0.0]) as pool:
        outcomes, bodies = score(pool, GROUP)
        assert pool.reward_model_client is not None and pool.reward_model_wait_s > 0
    assert [o.value for o in outcomes] == [10.0, 0.0, 10.0, 0.0]
    assert [o.parts["judged"] for o in outcomes] == [1.0, 0.0, 1.0, 0.0]
    assert [o.parts["behave"] for o in outcomes] == [0.0] * 4  # no completion equals the answer "2"
    assert bodies == [
        (
            "/generate",
            {
                "text": ["1+1=2ok", "1+1=3", "1+1=2 ok", "1+1="],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
            },
        )
    ]  # reward.judge's defaults


def test_timeouts_and_exceptions_of_model_rewards_are_failed_rewards_counted_by_the_policy():
    items = [("p", "sleep", "a"), ("p", "raise", "a"), ("p", "fine", "a"), ("p", "fine", "a")]
    with RewardPool(MISBEHAVES, workers=1, timeout_s=0.3) as pool:
        outcomes, _ = score(pool, items)
    assert [o.value for o in outcomes] == [None, None, 2.0, 2.0]
    assert outcomes[0].timed_out and outcomes[0].error == "timed out after 0.3 s"
    assert outcomes[1].error == "raised ValueError: the judge is unsure" and not outcomes[1].timed_out
    rewards, metrics = apply_failure_policy([outcomes[:2], outcomes[2:]], "drop")
    assert rewards == [None, [2.0, 2.0]]
    assert metrics == {"reward_errors": 2, "reward_timeouts": 1, "groups_dropped": 1}


def test_the_reward_model_failing_is_a_failed_reward_naming_the_server():
    async def drive(pool):
        async with fake_reward_models(1) as [fake]:
            fake.status = 400
            pool.use_reward_model([fake.address])
            return fake.address, await pool.score(GROUP[:2])

    with RewardPool([JUDGED, "tests.reward.fixtures:here_pid"], timeout_s=5) as pool:
        address, outcomes = run(drive(pool))
    assert all(o.value is None for o in outcomes)
    assert outcomes[0].error.startswith(
        f"judged: raised InferenceError: POST /generate on {address} failed with HTTP 400"
    )


def test_a_model_reward_before_use_reward_model_fails_clearly_and_score_sync_refuses():
    with RewardPool(JUDGED, timeout_s=5) as pool:
        [outcome] = asyncio.run(pool.score(GROUP[:1]))
        assert outcome.error.startswith("judged: needs the reward-model servers, and the pool was given none")
        with pytest.raises(RuntimeError, match="asks the reward model; await score"):
            pool.score_sync(GROUP[:1])
        with pytest.raises(ValueError, match="no addresses"):
            pool.use_reward_model([])


def test_a_pool_used_from_two_loops_makes_a_client_in_each_and_close_closes_it():
    with RewardPool(JUDGED, timeout_s=5) as pool:
        first, _ = score(pool, GROUP[:1])
        client = pool.reward_model_client
        second, _ = score(pool, GROUP[:1])
        assert pool.reward_model_client is not client and client._http._session is None  # closed
        client = pool.reward_model_client
    assert first[0].value == second[0].value == 1.0
    assert pool.reward_model_client is None and client._http._session is None


@pytest.mark.parametrize(
    "said, pattern, expected",
    [("Y", "^\\s*[Yy]", 1.0), (" yes", "^\\s*[Yy]", 1.0), ("N", "^\\s*[Yy]", 0.0), ("Score: 7/10", r"(\d+)/10", 7.0)],
)
def test_the_judges_answer_is_read_with_the_pattern(said, pattern, expected):
    assert score_answer(said, pattern) == expected


def test_an_answer_a_pattern_with_a_group_does_not_match_is_a_failure_naming_it():
    with pytest.raises(ValueError, match=r"the judge answered 'no idea'; reward.judge.pattern '\(\\\\d\+\)' does not"):
        score_answer("no idea", r"(\d+)")
    with pytest.raises(ValueError, match="reads 'x', not a number"):
        score_answer("grade x", r"grade (\w)")


def test_llm_judge_formats_the_template_with_the_rows_columns():
    sent = []

    class Client:
        async def generate(self, text, max_new_tokens, temperature):
            sent.append((text, max_new_tokens, temperature))
            return "Grade 4"

    judge = JudgeConfig(template="Q: {question} ({prompt}) A: {completion} ref {answer}", pattern=r"Grade (\d)")
    judge.max_new_tokens, judge.temperature = 5, 0.5
    model = RewardModel(Client(), judge)  # type: ignore[arg-type]
    value = asyncio.run(llm_judge("p", "c", "a", model, question="why?", level=3))
    assert value == 4.0 and sent == [("Q: why? (p) A: c ref a", 5, 0.5)]
    assert template_columns(judge.template) == ["question"]
    with pytest.raises(ValueError, match="names no column"):
        template_columns("{} {0}")


def judge_config(tmp_path, model_dir, **changes) -> Config:
    cfg = Config()
    cfg.reward.fn = "hpcrl.reward.judge:llm_judge"
    cfg.allocation.reward_model.workers = 1
    cfg.reward.model.path = str(model_dir)
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg.reward, section) if section != "allocation" else cfg.allocation.reward_model, name, value)
    return cfg


def test_preflight_refuses_a_model_reward_without_servers_of_its_kind(tiny_model, tmp_path):
    preflight(judge_config(tmp_path, tiny_model))  # the judge's settings as the config's defaults: accepted
    cases = [
        ({"allocation__workers": 0}, "allocation.reward_model.workers=0 is invalid: expected reward-model servers for"),
        ({"model__path": ""}, "reward.model.path='' is invalid: expected the reward model's directory"),
        ({"model__path": str(tmp_path / "none")}, "reward.model.path="),
        ({"model__kind": "discriminative"}, "reward.model.kind='discriminative' is invalid: expected generative"),
        ({"judge__template": "{prompt}{completion} {level}"}, "no column 'level' (named by reward.judge.template)"),
        ({"judge__template": "{prompt"}, "reward.judge.template='{prompt' is invalid: expected a str.format template"),
        ({"judge__template_file": str(tmp_path / "no.txt")}, "reward.judge.template_file="),
        ({"judge__pattern": "(Y"}, "reward.judge.pattern='(Y' is invalid: expected a Python regular expression"),
    ]
    for changes, message in cases:
        with pytest.raises(ConfigError) as error:
            preflight(judge_config(tmp_path, tiny_model, **changes))
        assert message in str(error.value) and "\n" not in str(error.value), (changes, str(error.value))
    score = judge_config(tmp_path, tiny_model)
    score.reward.fn = ["hpcrl.reward.builtin:mod10", "hpcrl.reward.judge:reward_model_score"]
    with pytest.raises(ConfigError, match=r"reward\.model\.kind='generative' is invalid: expected discriminative: "):
        preflight(score)
    head = tmp_path / "head"  # what check_model_dir looks for, with a score head's architecture
    head.mkdir()
    (head / "config.json").write_text('{"architectures": ["Qwen2ForSequenceClassification"]}')
    (head / "tokenizer.json").write_text("{}")
    (head / "model.safetensors").write_text("")
    with pytest.raises(
        ConfigError, match=r"kind='generative' is invalid: expected discriminative: reward\.model\.path's"
    ):
        preflight(judge_config(tmp_path, head))
    score.reward.model.path, score.reward.model.kind = str(head), "discriminative"
    preflight(score)
    (tmp_path / "judge.txt").write_text("{prompt}{completion}?")
    preflight(judge_config(tmp_path, tiny_model, judge__template_file=str(tmp_path / "judge.txt")))


def test_a_run_naming_a_model_reward_without_its_servers_fails_in_one_line_before_anything_starts(tmp_path):
    runs = tmp_path / "runs"
    result = run_main("reward.fn=hpcrl.reward.judge:llm_judge", "run.trial=t", f"run.root={runs}", cwd=tmp_path)
    assert one_error_line(result).startswith(
        "hpcrl: config error: allocation.reward_model.workers=0 is invalid: expected reward-model servers for "
        "'hpcrl.reward.judge:llm_judge', which asks the reward model"
    )
    assert not [p for p in runs.rglob("*") if p.is_file() and ".hydra" not in p.parts]  # no run directory, no worker
