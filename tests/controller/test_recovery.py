"""Checkpoint bookkeeping of the controller: its state file, completeness, the newest complete checkpoint."""

import json
import logging
import random

import numpy as np
import pytest
import torch

from hpcrl.controller.metrics import cut_metrics, read_metrics
from hpcrl.controller.recovery import (
    CONTROLLER_FILE,
    Checkpoints,
    ControllerState,
    find_checkpoint,
    rng_states,
    set_rng_states,
)


def state_of(step: int) -> ControllerState:
    return ControllerState(
        step=step,
        weight_version=step,
        rows={"size": 7, "seed": 0, "drawn": 3 * step, "replay": [{"prompt": "1+2=", "answer": "3"}]},
        counters={"reward_errors": 1, "groups_dropped": 1, "groups_equal_reward": 0},
        groups_rejected=2,
        eval_accuracy_before=0.0,
        eval_accuracy_last=0.5,
        rng=rng_states(),
    )


def save(checkpoints: Checkpoints, step: int) -> ControllerState:
    """A checkpoint as the loop writes one: the trainers' part, then the controller's state."""
    checkpoints.step_dir(step).mkdir(parents=True)
    (checkpoints.step_dir(step) / "trainer_state.json").write_text("{}")
    state = state_of(step)
    checkpoints.publish(state)
    return state


def test_the_controller_state_comes_back_as_it_was_saved(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    save(checkpoints, 2)
    saved = save(checkpoints, 4)
    assert checkpoints.latest() == (tmp_path / "step_000004", saved)
    assert (tmp_path / "latest").read_text() == "step_000004\n"


def test_rng_states_round_trip_through_json():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    saved = json.loads(json.dumps(rng_states()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_states(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_interrupted_checkpoints_are_skipped_and_deleted(tmp_path, caplog):
    checkpoints = Checkpoints(tmp_path)
    save(checkpoints, 2)
    save(checkpoints, 4)
    (tmp_path / "step_000006").mkdir()  # the trainers finished, the controller's state was never written
    (tmp_path / "step_000006" / "trainer_state.json").write_text("{}")
    (tmp_path / "step_000008.partial").mkdir()  # the trainers were writing
    (tmp_path / "step_000004" / CONTROLLER_FILE).with_name(".controller.json.x1y2").write_text("{")  # a torn temp
    with caplog.at_level(logging.WARNING):
        path, state = find_checkpoint("auto", checkpoints)
    assert (path.name, state.step) == ("step_000004", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert "step_000008.partial" in caplog.text and "interrupted checkpoint" in caplog.text


def test_no_checkpoint_means_a_fresh_start(tmp_path, caplog):
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    with caplog.at_level(logging.INFO):
        assert find_checkpoint("auto", checkpoints) is None
    assert "no complete checkpoint" in caplog.text
    save(checkpoints, 2)
    assert find_checkpoint("off", checkpoints) is None, "recover.mode=off never resumes"


def test_metrics_are_cut_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    assert cut_metrics(path, 4) == 3
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    assert cut_metrics(tmp_path / "absent.jsonl", 4) == 0


def test_a_state_file_of_another_version_is_refused_with_its_path(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    save(checkpoints, 2)
    (tmp_path / "step_000002" / CONTROLLER_FILE).write_text('{"step": 2}')
    with pytest.raises(ValueError, match=r"step_000002/controller\.json is not a controller state"):
        checkpoints.latest()


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    for step in (2, 4, 6):
        save(checkpoints, step)
    (tmp_path / "step_000008.partial").mkdir()  # a save in progress is never pruned
    save(checkpoints, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000006", "step_000008", "step_000008.partial"]
    assert checkpoints.latest()[1].step == 8


def test_keep_zero_keeps_every_checkpoint(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=0)
    for step in (2, 4, 6):
        save(checkpoints, step)
    assert [p.name for p in checkpoints.complete()] == ["step_000002", "step_000004", "step_000006"]
