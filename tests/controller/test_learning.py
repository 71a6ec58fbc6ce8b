"""Each algorithm learns the default task: held-out greedy accuracy rises from below 0.3 to 0.8 or more within
a step budget measured here (README's algorithm section gives the figures), not only that its metrics exist.

The run stops at the first eval (every 5 steps) that reaches 0.8 (``eval.stop_at_accuracy``). With the default
``run.seed`` and synchronous rollout the samples are seeded, so a run repeats closely; the budgets are about 1.5x
the most steps measured over run.seed 0 and 1.

``dr_grpo`` is not run here: it is ``grpo`` with the group mean alone as baseline and a constant normaliser, which
tests/train/test_algorithms.py checks exactly (``group_center``, ``aggregate``); ``bench/algorithms.py --target 0.8
--algorithms dr_grpo`` runs it to the target (README: 60 and 55 steps on run.seed 0 and 1). The suite's time is
held to 45 minutes on two cores.
"""

import re

import pytest

from tests.controller.test_job import metrics_of, processes_of, run_job, summary_of

# preset -> (overrides, step budget); measured steps to 0.8 (run.seed 0, 1): see README
PRESETS = {
    "grpo": (["algorithm=grpo"], 110),
    "dapo": (["algorithm=dapo", "checkpoint.every_steps=20"], 90),
    "reinforce_pp": (["algorithm=reinforce_pp"], 150),
    "decoupled-ppo-staleness-2": (["algorithm.behavior_weight_cap=5", "rollout.max_staleness=2"], 120),
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_algorithm_takes_held_out_accuracy_from_below_03_to_08(tmp_path, preset):
    overrides, budget = PRESETS[preset]
    common = [f"run.trial={preset}", f"run.max_steps={budget}", "eval.every_steps=5", "eval.stop_at_accuracy=0.8"]
    result = run_job(tmp_path, *common, *overrides, timeout=900)
    summary = summary_of(result)
    assert summary["eval_accuracy_before"] < 0.3, summary
    assert summary["eval_accuracy_after"] >= 0.8, f"{preset} did not reach 0.8 in {budget} steps: {summary}"
    rows = metrics_of(tmp_path / "default" / preset)
    accuracy = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    assert accuracy[-1] >= 0.8 and all(a < 0.8 for a in accuracy[:-1]), "it stopped at the first eval at 0.8"
    if preset == "grpo":  # the default job's algorithm: what every run gives its user, checked once here
        check_run_outputs(result, summary, tmp_path / "default" / preset, rows)
    if preset == "reinforce_pp":  # its KL term to the frozen reference policy, reported every step
        assert all("kl" in r for r in rows)
    if preset == "dapo":  # checkpoints as it goes: the newest complete ones, trainer state and controller's
        checkpoints = tmp_path / "default" / preset / "checkpoints"
        kept = sorted(p.name for p in checkpoints.iterdir() if p.name != "latest")
        assert kept and (checkpoints / kept[-1] / "trainer_state.json").is_file(), kept
        assert (checkpoints / kept[-1] / "controller.json").is_file()
        assert (checkpoints / "latest").read_text().strip() == kept[-1]
    if "rollout.max_staleness=2" in overrides:
        assert max(r["staleness_max"] for r in rows) == 2, "the rollout ran two versions ahead"
        assert all("behavior_weight_mean" in r for r in rows)
        # the gap of the proximal policy to the servers' logprobs: stale samples make it grow
        assert all(r["mismatch_abs_max"] >= r["mismatch_abs_mean"] >= 0 and r["mismatch_kl_k3"] >= 0 for r in rows)
        assert max(r["mismatch_abs_mean"] for r in rows if r["staleness_max"] == 2) > 0


def check_run_outputs(result, summary, run_dir, rows) -> None:
    """The summary line, a metrics row per step with its keys, TensorBoard events, the metrics plot, a progress
    bar with the reward, and no process of the run left."""
    assert set(summary) >= {"steps", "wall_s", "eval_accuracy_before", "eval_accuracy_after", "run_dir", "final_model"}
    assert summary["run_dir"] == str(run_dir)
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))
    for key in ("reward_mean", "loss", "staleness_max", "time_step_s", "time_train_s", "time_rollout_wait_s"):
        assert all(key in r for r in rows), key
    assert rows[-1]["reward_mean"] > rows[0]["reward_mean"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    assert re.search(r"progress: step \d+ of \d+", result.stderr), "progress lines where stderr is no terminal"
    said = re.search(r"start-up took ([\d.]+) s to the first step: python, imports, config [\d.]+ s, .*", result.stderr)
    assert said and float(said[1]) == pytest.approx(summary["startup_s"], abs=0.06), "the start-up line and its total"
    phases = [float(s) for s in re.findall(r" ([\d.]+) s(?:,|$)", said[0].split(": ", 1)[1])]
    assert len(phases) == 5 and sum(phases) == pytest.approx(summary["startup_s"], abs=0.3), said[0]
    assert not processes_of(str(run_dir)), "no process of the run outlives it"


# run.seed 0 measured 85 and 90 steps to 0.9 (seed 1: 135; bench/algorithms.py): runs of a seed differ, and one CI
# run plateaued at 0.87 from step 90 and had 0.89 at 135; the budget is about 1.5x the slowest run measured
PPO_BUDGET = 200


@pytest.mark.slow
def test_ppo_with_a_critic_reaches_09_and_its_critic_learns(tmp_path):
    """``algorithm=ppo``: GAE from a learned critic takes held-out accuracy to 0.9, and the critic learns
    something early: its explained variance (values before its update against the batch's returns) is 0 at
    step 1 (a zero head), above 0 on average over steps 21-40, and higher over the last 10 steps than the first."""
    overrides = [f"run.max_steps={PPO_BUDGET}", "eval.every_steps=5", "eval.stop_at_accuracy=0.9"]
    summary = summary_of(run_job(tmp_path, "run.trial=ppo", "algorithm=ppo", *overrides, timeout=900))
    assert summary["eval_accuracy_after"] >= 0.9, f"ppo did not reach 0.9 in {PPO_BUDGET} steps: {summary}"
    assert "final_critic" in summary
    rows = metrics_of(tmp_path / "default" / "ppo")
    explained = [r["critic_explained_var"] for r in rows]
    assert explained[0] == 0.0, "a fresh zero head explains nothing"
    early = sum(explained[20:40]) / 20
    assert early > 0.005, f"mean explained variance over steps 21-40 is {early}: the critic learned nothing"
    assert sum(explained[-10:]) / 10 > sum(explained[:10]) / 10 + 0.05, explained
    for key in ("critic_loss", "critic_clip_frac", "critic_value_mean", "return_mean", "critic_grad_norm", "kl"):
        assert all(key in r for r in rows), key


# measured 2026-12-03: 0.935 at step 60 by disk, and by distributed sync (README's LoRA paragraph), 0.815 at step 45;
# the budget is 2x the steps to 0.8
LORA_BUDGET = 90
LORA = ["train.lora.rank=8", "train.lr=1e-3", "model.tiny.hidden_size=256", "model.tiny.intermediate_size=1024"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # 115 s alone to 0.9; the whole suite beside it made its job take 506 s (60 steps)
def test_lora_by_distributed_sync_reaches_08_and_its_final_adapter_answers_as_measured(tmp_path):
    """``train.lora.rank=8`` (docs/lora.md's settings for the tiny task) with the adapter sent in the body each step:
    held-out accuracy from below 0.3 to 0.8; the servers' weight version follows the steps (set after each
    adapter's load); ``final/`` is a PEFT adapter whose greedy answers on the base score what the last evaluation
    measured."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpcrl.data import make_mod10
    from tests.controller.test_final_model import greedy_accuracy_of

    overrides = [f"run.max_steps={LORA_BUDGET}", "eval.every_steps=5", "eval.stop_at_accuracy=0.8"]
    result = run_job(tmp_path, "run.trial=lora", *LORA, "train.weight_sync=distributed", *overrides, timeout=900)
    summary = summary_of(result)
    assert summary["eval_accuracy_before"] < 0.3 <= 0.8 <= summary["eval_accuracy_after"], summary
    assert "train.weight_sync=distributed with train.lora: the adapter goes to the servers in the body" in result.stderr
    run_dir = tmp_path / "default" / "lora"
    rows = metrics_of(run_dir)
    assert rows[-1]["token_version_min"] == summary["steps"] - 1, "each step samples with the adapter of the one before"
    final = run_dir / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}
    assert not (final / "model.safetensors").exists(), "the adapter alone, not the model"
    base = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
    held_out = list(make_mod10(2000, 200, 0)[1])
    adapted = PeftModel.from_pretrained(base, final)
    assert greedy_accuracy_of(run_dir / "model", held_out, model=adapted) == summary["eval_accuracy_after"]
