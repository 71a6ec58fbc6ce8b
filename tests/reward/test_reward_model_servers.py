"""Model rewards against real CPU servers (``python -m hpcrl.inference.server``): the builtin llm_judge asking the
tiny mod10 judge, and reward_model_score asking a tiny sequence-classification model, each a group scored in one
batched request with the right scores."""

import pytest

from hpcrl.config.schema import JudgeConfig
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.reward.pool import RewardPool
from tests.inference.conftest import ServerProc
from tests.inference.test_client_fakes import run
from tests.inference.test_server_classify import make_reward_model, own_scores
from tests.models.test_mod10_judge import CASES

MOD10_JUDGE = JudgeConfig(template="{prompt}{completion}?", pattern="^Y", max_new_tokens=3, temperature=0.0)


async def scored(pool: RewardPool, address: str, items):
    pool.use_reward_model([address])
    return await pool.score(items)


def test_llm_judge_scores_a_group_of_right_and_wrong_answers_in_one_request(mod10_judge_dir, tmp_path):
    items = [(prompt, completion, "unused") for prompt, completion, _ in CASES]
    server = ServerProc(mod10_judge_dir, tmp_path / "judge.log")
    try:
        with RewardPool("hpcrl.reward.judge:llm_judge", timeout_s=60, judge=MOD10_JUDGE) as pool:
            outcomes = run(scored(pool, server.address, items), timeout_s=120)
            client = pool.reward_model_client
    finally:
        server.stop()
    assert [o.error for o in outcomes] == [None] * len(CASES)
    assert [o.value for o in outcomes] == [1.0 if verdict == "Y" else 0.0 for _, _, verdict in CASES]
    assert (client.requests, client.prompts) == (1, len(CASES)) and client.wait_s > 0


def test_reward_model_score_scores_a_group_through_classify(tmp_path):
    model = make_reward_model(tmp_path / "reward-model")
    items = [("2+3=", "5", ""), ("2+3=", "6", ""), ("9+9=", "18", "")]
    server = ServerProc(model, tmp_path / "reward.log")
    try:
        with RewardPool("hpcrl.reward.judge:reward_model_score", timeout_s=60, model_kind="discriminative") as pool:
            outcomes = run(scored(pool, server.address, items), timeout_s=120)
            client = pool.reward_model_client
    finally:
        server.stop()
    tokenizer = load_tokenizer(model)
    expected = own_scores(model, [tokenizer(p + c)["input_ids"] for p, c, _ in items])
    assert [o.value for o in outcomes] == [pytest.approx(e[0], abs=1e-5) for e in expected]
    assert len({round(o.value, 4) for o in outcomes}) == 3  # three different scores: the texts were each read
    assert (client.requests, client.prompts) == (1, 3)
