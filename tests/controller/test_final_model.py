"""The trained model at the end, and a run that can be followed: ``<run dir>/final/`` in Hugging Face layout, which
``AutoModelForCausalLM`` loads and which generates what the last evaluation measured (its greedy accuracy on the
held-out rows is the summary's ``eval_accuracy_after``); ``export.every_steps`` keeps the model of earlier steps;
the controller's log has a line per step and per evaluation."""

import re
import stat

import pytest

from hpcrl.data import make_mod10
from hpcrl.reward.builtin import mod10
from hpcrl.rundir import current_umask
from tests.controller.test_job import metrics_of, run_job, summary_of

STEPS, EVAL_SIZE = 6, 100


def greedy_accuracy_of(model_dir, rows, model=None) -> float:
    """Greedy completions of ``rows``' prompts by the model in ``model_dir`` (or ``model``, with that directory's
    tokenizer), scored by the task's reward, as the run's evaluation does (two new tokens, the end-of-sequence token
    and padding dropped)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.models.tokenizer import load_tokenizer

    model = model or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    scores = []
    with torch.no_grad():
        for row in rows:
            ids = tokenizer(row["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            completion = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            scores.append(mod10(row["prompt"], completion, row["answer"]))
    return sum(scores) / len(scores)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A short default job that exports every 2 steps and checkpoints every 3: (summary, run directory)."""
    tmp = tmp_path_factory.mktemp("final")
    overrides = ["run.trial=final", f"run.max_steps={STEPS}", "eval.every_steps=3", "eval.stop_at_accuracy=0"]
    overrides += [f"dataset.eval_size={EVAL_SIZE}", "rollout.prompts_per_step=32", "export.every_steps=2"]
    overrides += ["checkpoint.every_steps=3"]
    result = run_job(tmp, *overrides)
    return summary_of(result), tmp / "default" / "final"


@pytest.mark.slow
def test_the_final_model_generates_what_the_last_evaluation_measured(finished):
    summary, run_dir = finished
    assert summary["final_model"] == str(run_dir / "final")
    held_out = list(make_mod10(2000, EVAL_SIZE, 0)[1])  # the run's held-out rows: dataset.train_size, run.seed
    assert greedy_accuracy_of(run_dir / "final", held_out) == summary["eval_accuracy_after"]
    # the same measure of the untrained model gives the accuracy before, and differs: the export is the trained one
    assert greedy_accuracy_of(run_dir / "model", held_out) == summary["eval_accuracy_before"]
    assert summary["eval_accuracy_after"] != summary["eval_accuracy_before"]


@pytest.mark.slow
def test_intermediate_exports_are_the_model_of_their_step(finished):
    from safetensors.torch import load_file

    _, run_dir = finished
    exports = run_dir / "exports"
    assert sorted(p.name for p in exports.iterdir()) == ["step_000002", "step_000004", "step_000006"]
    final = load_file(run_dir / "final" / "model.safetensors")
    last = load_file(exports / "step_000006" / "model.safetensors")
    earlier = load_file(exports / "step_000002" / "model.safetensors")
    assert final.keys() == last.keys() == earlier.keys()
    assert all((final[k] == last[k]).all() for k in final), "the last step's export is the final model"
    assert any((final[k] != earlier[k]).any() for k in final), "step 2's export is step 2's model"
    for export in (run_dir / "final", exports / "step_000002"):
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in export.iterdir()}
    assert all("time_export_s" in m for m in metrics_of(run_dir) if m["step"] % 2 == 0)


@pytest.mark.slow
def test_exported_files_have_the_umasks_mode_so_teammates_can_read_them(finished):
    # safetensors writes 0600: model.safetensors in final/ was unreadable to a shared cluster's group
    _, run_dir = finished
    mode = 0o666 & ~current_umask()
    assert mode & 0o040, "the tests run with a umask that lets the group read"
    for export in (run_dir / "final", run_dir / "exports" / "step_000002"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in export.iterdir() if p.is_file()}
        assert "model.safetensors" in modes and set(modes.values()) == {mode}, modes


@pytest.mark.slow
def test_the_controller_log_has_a_line_per_step_and_per_evaluation(finished):
    summary, run_dir = finished
    log = (run_dir / "logs" / "controller-0.log").read_text()
    metrics = {m["step"]: m for m in metrics_of(run_dir)}
    steps = re.findall(r"step (\d+): reward ([\d.]+)(?:, accuracy ([\d.]+))?.*?, ([\d.]+) s, staleness", log)
    assert [int(s[0]) for s in steps] == list(range(1, STEPS + 1))
    for step, reward, accuracy, seconds in steps:
        m = metrics[int(step)]
        assert float(reward) == pytest.approx(m["reward_mean"], abs=5e-4)
        assert float(seconds) == pytest.approx(m["time_step_s"], abs=5.1e-3)  # to 2 decimals: 0.415 may print 0.41
        assert (accuracy != "") == ("eval_accuracy" in m)
    evaluations = re.findall(r"evaluation at step (\d+): held-out greedy accuracy ([\d.]+)", log)
    assert [int(s) for s, _ in evaluations] == [3, 6]
    assert float(evaluations[-1][1]) == pytest.approx(summary["eval_accuracy_after"], abs=5e-4)


def evaluate_only(root, trial: str, model_path) -> dict:
    """``run.max_steps=0`` on ``model_path`` with the fixture run's held-out set: its summary."""
    overrides = ["run.max_steps=0", "model=local", f"model.path={model_path}", f"dataset.eval_size={EVAL_SIZE}"]
    return summary_of(run_job(root, f"run.trial={trial}", *overrides))


@pytest.mark.slow
def test_evaluation_only_measures_a_final_model_and_a_checkpoint_as_their_run_did(finished, tmp_path):
    import json

    summary, run_dir = finished
    final = evaluate_only(tmp_path, "final", run_dir / "final")
    assert final["steps"] == 0 and final["eval_rows"] == EVAL_SIZE
    assert final["eval_accuracy"] == summary["eval_accuracy_after"]
    assert final["evaluated_model"] == str(run_dir / "final")
    eval_dir = tmp_path / "default" / "final"
    samples = [json.loads(line) for line in (eval_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == EVAL_SIZE
    assert sum(s["reward"] for s in samples) / EVAL_SIZE == final["eval_accuracy"]
    assert all(mod10(s["prompt"], s["completion"], s["answer"]) == s["reward"] for s in samples)
    assert sorted(p.name for p in (eval_dir / "logs").iterdir() if p.name.startswith("trainer")) == []
    # a checkpoint: the model of step 3, as that step's evaluation measured it (not the final one's)
    step3 = evaluate_only(tmp_path, "step3", run_dir / "checkpoints" / "step_000003")
    assert step3["eval_accuracy"] == metrics_of(run_dir)[2]["eval_accuracy"] != summary["eval_accuracy_after"]
