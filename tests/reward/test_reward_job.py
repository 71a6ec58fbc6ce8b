"""A run whose reward.fn is a weighted list of two functions, one of which reads a column of the row: each function's
part is logged under its name, and the reward trained on is their weighted sum."""

import json

import pytest

from tests.controller.test_job import metrics_of, run_job, summary_of

ROWS = 40  # 8 held out, 32 to train on


@pytest.mark.slow
def test_a_weighted_list_of_rewards_logs_each_part_and_trains_on_their_sum(tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i % 10}+{i // 10}=", "answer": str((i % 10 + i // 10) % 10),
                                        "bonus": 3}) + "\n" for i in range(ROWS)))  # fmt: skip
    result = run_job(
        tmp_path,
        "run.trial=parts",
        "dataset=files",
        f"dataset.train_files=[{data}]",
        "dataset.holdout=8",
        "dataset.chat_template=false",
        "reward.fn=[hpcrl.reward.builtin:mod10,tests.reward.fixtures:bonus]",
        "reward.weights=[1.0,0.5]",
        "reward.workers=1",
        "run.max_steps=2",
        "rollout.prompts_per_step=8",
        "eval.every_steps=0",
        "eval.stop_at_accuracy=0",
    )
    summary = summary_of(result)
    split = "dataset: 40 rows in dataset.train_files: 32 to train on, 8 held out for evaluation (dataset.holdout=8"
    assert split in result.stderr, "the split, on the console"
    rows = metrics_of(tmp_path / "default" / "parts")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/bonus"] == 3.0, "the column, read from the row by the reward's parameter"
        assert 0.0 <= r["reward/mod10"] <= 1.0
        assert r["reward_mean"] == pytest.approx(r["reward/mod10"] + 0.5 * 3.0)
    # held-out accuracy is the mean of the same weighted sum: 1.5 for a wrong answer, 2.5 for a right one
    assert 1.5 <= summary["eval_accuracy_after"] <= 2.5
