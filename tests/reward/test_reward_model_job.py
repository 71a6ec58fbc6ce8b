"""Runs whose only reward comes from the reward model's own servers (slow): ``experiment=mod10_judge``, where a tiny
generative judge says whether each answer is right, learns the task; a discriminative reward model's scores are the
run's rewards, exactly, and the policy climbs them (scored on a rollout worker, whose own pool asks the servers)."""

import json

import pytest
import torch

from hpcrl.models.tiny import make_tokenizer, qwen2_config
from hpcrl.models.tokenizer import mark_exact
from tests.controller.test_job import metrics_of, run_job, summary_of

JUDGE_BUDGET = 100  # steps to 0.9 measured here: 65 (run.seed 0) and 55 (run.seed 1)
LIKED = "7"  # the digit the discriminative reward model below scores highest


@pytest.mark.slow
def test_mod10_judge_learns_to_09_held_out_with_only_the_judges_reward(tmp_path, mod10_judge_dir):
    overrides = ["experiment=mod10_judge", f"reward.model.path={mod10_judge_dir}", f"run.max_steps={JUDGE_BUDGET}"]
    summary = summary_of(run_job(tmp_path, "run.trial=judge", *overrides, timeout=900))
    assert summary["eval_accuracy_before"] < 0.3, summary
    assert summary["eval_accuracy_after"] >= 0.9, f"not 0.9 within {JUDGE_BUDGET} steps: {summary}"
    run_dir = tmp_path / "mod10_judge" / "judge"
    rows = metrics_of(run_dir)
    # every step's rewards came through the judge's server: its batched requests took time at each step
    assert all(r["time_reward_model_s"] > 0 for r in rows), [r["time_reward_model_s"] for r in rows]
    config = (run_dir / "config.yaml").read_text()
    assert "fn: hpcrl.reward.judge:llm_judge" in config and "reward_fn: hpcrl.reward.builtin:mod10" in config


def make_digit_liking_reward_model(out):
    """A tiny Qwen2ForSequenceClassification whose score is ``sqrt(hidden)`` (8) for text ending in ``LIKED`` and
    about +-1 for any other last character: every layer's output projections are zero, so the last position's
    hidden state is its token's embedding (RMS-normed), and the score head is ``LIKED``'s embedding, normalised."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = make_tokenizer()
    config = qwen2_config(tokenizer, 64, 2, 4, 256)
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        liked = model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(LIKED)]
        model.score.weight.copy_((liked / liked.norm()).unsqueeze(0))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    mark_exact(out)
    return out


def own_score(model, tokenizer, text: str) -> float:
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


@pytest.mark.slow
def test_a_discriminative_reward_models_scores_are_the_rewards_on_a_rollout_worker_and_the_policy_climbs_them(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = make_digit_liking_reward_model(tmp_path / "reward-model")
    overrides = [
        *("run.trial=rm", "run.max_steps=12", "eval.every_steps=0", "eval.stop_at_accuracy=0"),
        *("allocation.reward_model.workers=1", f"reward.model.path={model_dir}", "reward.model.kind=discriminative"),
        *("reward.fn=hpcrl.reward.judge:reward_model_score", "rollout.max_new_tokens=1"),
        *("eval.reward_fn=hpcrl.reward.builtin:mod10", "metrics.samples_every_steps=1", "rollout.workers=1"),
    ]
    summary_of(run_job(tmp_path, *overrides, timeout=600))
    run_dir = tmp_path / "default" / "rm"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert own_score(model, tokenizer, "3+4=" + LIKED) == pytest.approx(8.0, abs=0.05)
    logged = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    scored = [(row["prompt"] + c["text"], c["reward"]) for row in logged[:2] for c in row["completions"]]
    for text, reward in scored:  # the run's rewards are the model's own scores of prompt + completion
        assert reward == pytest.approx(own_score(model, tokenizer, text), abs=1e-4), text
    rewards = [r["reward_mean"] for r in metrics_of(run_dir)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 1.0, f"the policy did not climb the scores: {rewards}"
