"""Checkpoint bookkeeping of the controller: its state file, completeness, durability, the newest usable
checkpoint. The trainers' part of every checkpoint here is a real one, written by a 1-rank engine."""

import json
import logging
import os
import random
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpcrl.config.schema import TrainConfig
from hpcrl.controller.metrics import cut_metrics, read_metrics
from hpcrl.controller.recovery import (
    CONTROLLER_FILE,
    Checkpoints,
    ControllerState,
    resume_candidates,
    rng_states,
    set_rng_states,
)
from hpcrl.train.checkpoint import STATE_FILE, check_checkpoint, save_checkpoint
from hpcrl.train.dist import init_distributed
from hpcrl.train.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_model):
    """A 1-rank engine (FSDP2 over gloo) whose checkpoints are the trainers' part of every checkpoint here."""
    created = not dist.is_initialized()
    engine = Engine(tiny_model, TrainConfig(), dist=init_distributed())
    engine.setup()
    yield engine
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trainer_part(engine, tmp_path_factory):
    return save_checkpoint(engine, tmp_path_factory.mktemp("trainer-part") / "step")


@pytest.fixture
def save(trainer_part):
    def save(checkpoints: Checkpoints, step: int) -> ControllerState:
        """A checkpoint as the loop writes one: the trainers' part, then the controller's state."""
        shutil.copytree(trainer_part, checkpoints.step_dir(step))
        state = state_of(step)
        checkpoints.publish(state)
        return state

    return save


def newest(checkpoints: Checkpoints) -> tuple:
    path, state = next(resume_candidates("auto", checkpoints))
    return path.name, state.step


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


def test_the_controller_state_comes_back_as_it_was_saved(tmp_path, save):
    checkpoints = Checkpoints(tmp_path)
    save(checkpoints, 2)
    saved = save(checkpoints, 4)
    assert next(resume_candidates("auto", checkpoints)) == (tmp_path / "step_000004", saved)
    assert (tmp_path / "latest").read_text() == "step_000004\n"


def test_rng_states_round_trip_through_json():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    saved = json.loads(json.dumps(rng_states()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_states(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_interrupted_checkpoints_are_skipped_and_deleted(tmp_path, caplog, save):
    checkpoints = Checkpoints(tmp_path)
    save(checkpoints, 2)
    save(checkpoints, 4)
    (tmp_path / "step_000006").mkdir()  # the trainers finished, the controller's state was never written
    (tmp_path / "step_000006" / "trainer_state.json").write_text("{}")
    (tmp_path / "step_000008.partial").mkdir()  # the trainers were writing
    (tmp_path / "step_000004" / CONTROLLER_FILE).with_name(".controller.json.x1y2").write_text("{")  # a torn temp
    with caplog.at_level(logging.WARNING):
        assert newest(checkpoints) == ("step_000004", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert "step_000008.partial" in caplog.text and "interrupted checkpoint" in caplog.text


def test_no_checkpoint_means_a_fresh_start(tmp_path, save):
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    assert list(resume_candidates("auto", checkpoints)) == []
    save(checkpoints, 2)
    assert list(resume_candidates("off", checkpoints)) == [], "recover.mode=off never resumes"


def test_metrics_are_cut_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    assert cut_metrics(path, 4) == 3
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    assert cut_metrics(tmp_path / "absent.jsonl", 4) == 0


def test_a_state_file_of_another_version_is_set_aside_for_the_one_before(tmp_path, caplog, save):
    checkpoints = Checkpoints(tmp_path)
    save(checkpoints, 2)
    save(checkpoints, 4)
    (tmp_path / "step_000004" / CONTROLLER_FILE).write_text('{"step": 4}')
    with caplog.at_level(logging.WARNING):
        assert newest(checkpoints) == ("step_000002", 2)
    assert "step_000004 cannot be resumed from: controller.json is not a controller state" in caplog.text


def test_only_the_newest_checkpoints_are_kept(tmp_path, save):
    checkpoints = Checkpoints(tmp_path, keep=2)
    for step in (2, 4, 6):
        save(checkpoints, step)
    (tmp_path / "step_000008.partial").mkdir()  # a save in progress is never pruned
    save(checkpoints, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000006", "step_000008", "step_000008.partial"]
    assert newest(checkpoints) == ("step_000008", 8)
    assert (tmp_path / "latest").read_text() == "step_000008\n"


def test_keep_zero_keeps_every_checkpoint(tmp_path, save):
    checkpoints = Checkpoints(tmp_path, keep=0)
    for step in (2, 4, 6):
        save(checkpoints, step)
    assert [p.name for p in checkpoints.complete()] == ["step_000002", "step_000004", "step_000006"]


# ---------------------------------------------------------------- a checkpoint a crash left unusable


def _delete(path):
    path.unlink()


def _cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _tensor_file(step_dir):
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize(
    ("damage", "part", "why"),
    [
        (_delete, lambda d: d / STATE_FILE, "trainer_state.json is missing"),
        (_cut_in_half, lambda d: d / STATE_FILE, "trainer_state.json is not a trainer state"),
        (_delete, _tensor_file, "the tensor file __0_0.distcp is missing"),
        (_cut_in_half, _tensor_file, "the tensor file __0_0.distcp is cut short"),
        (_cut_in_half, lambda d: d / ".metadata", "the tensors' metadata (.metadata) cannot be read"),
    ],
    ids=["state-deleted", "state-truncated", "tensors-deleted", "tensors-truncated", "metadata-truncated"],
)
def test_a_newest_checkpoint_with_a_part_missing_or_cut_short_gives_way_to_the_one_before(
    tmp_path, caplog, save, damage, part, why
):
    checkpoints = Checkpoints(tmp_path, keep=2)
    save(checkpoints, 2)
    save(checkpoints, 4)
    damage(part(checkpoints.step_dir(4)))
    assert check_checkpoint(checkpoints.step_dir(4)).startswith(why)
    with caplog.at_level(logging.WARNING):
        assert newest(checkpoints) == ("step_000002", 2)
    assert f"checkpoint step_000004 cannot be resumed from: {why}" in caplog.text
    assert "kept as step_000004.broken" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000004.broken"]
    save(checkpoints, 4)  # the resumed run checkpoints step 4 again; the set-aside one counts for nothing
    save(checkpoints, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004", "step_000004.broken", "step_000006"]
    assert checkpoints.remove_incomplete() == [], "a set-aside checkpoint is not an interrupted save"


def test_when_no_checkpoint_is_usable_the_run_starts_fresh_and_each_is_set_aside(tmp_path, caplog, save):
    checkpoints = Checkpoints(tmp_path, keep=2)
    save(checkpoints, 2)
    save(checkpoints, 4)
    _cut_in_half(_tensor_file(checkpoints.step_dir(4)))  # a node crash before the data reached the disk
    _delete(checkpoints.step_dir(2) / STATE_FILE)  # and the older one lost its state
    with caplog.at_level(logging.WARNING):
        assert list(resume_candidates("auto", checkpoints)) == []
    assert "checkpoint step_000004 cannot be resumed from: the tensor file __0_0.distcp is cut short" in caplog.text
    assert "checkpoint step_000002 cannot be resumed from: trainer_state.json is missing" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002.broken", "step_000004.broken"]


def test_an_older_checkpoint_is_only_checked_when_the_newer_fails(tmp_path, save):
    checked = []
    checkpoints = Checkpoints(tmp_path, check_trainers=lambda path: checked.append(path.name))
    save(checkpoints, 2)
    save(checkpoints, 4)
    assert newest(checkpoints) == ("step_000004", 4)
    assert checked == ["step_000004"]


def test_every_part_of_a_checkpoint_is_fsynced_before_it_is_marked_complete(tmp_path, monkeypatch, engine):
    # what a crash of the node keeps is what was fsynced: every file, then the directory holding it
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    checkpoints = Checkpoints(tmp_path)
    step_dir = checkpoints.step_dir(2)
    save_checkpoint(engine, step_dir)
    trainer_files = sorted(str(p) for p in step_dir.iterdir())
    trainers_done = len(synced)
    checkpoints.publish(state_of(2))
    published = synced[trainers_done:]

    partial = f"{step_dir}.partial"
    # DCP writes .metadata as .metadata.tmp, fsyncs and renames it; the directory's fsync covers the rename
    trainer_synced = [s.replace(partial, str(step_dir)).removesuffix(".tmp") for s in synced[:trainers_done]]
    assert set(trainer_files) <= set(trainer_synced), "every file of the trainers' part"
    assert trainer_synced.index(str(step_dir)) > max(trainer_synced.index(f) for f in trainer_files), (
        "the directory after its files"
    )
    assert trainer_synced[-1] == str(tmp_path), "the rename of .partial into place"
    marker = published.index(str(step_dir))
    assert any(s.startswith(f"{step_dir}/.{CONTROLLER_FILE}.") for s in published[:marker]), "controller.json first"
    assert published[-1] == str(tmp_path), "latest, renamed into place last"


def test_a_checkpoint_with_a_critic_is_usable_only_with_its_critic_part(tmp_path, monkeypatch):
    """With a critic, a checkpoint whose critic/ part is missing or damaged is unusable, said as the critic's."""
    from hpcrl.controller import loop

    damaged = {tmp_path / "critic": "trainer_state.json is missing"}
    monkeypatch.setattr(loop, "check_checkpoint", lambda path: damaged.get(path))
    assert loop._check_with_critic(tmp_path) == "the critic's part: trainer_state.json is missing"
    damaged = {tmp_path: "the tensor file x is cut short", tmp_path / "critic": "trainer_state.json is missing"}
    assert loop._check_with_critic(tmp_path) == "the tensor file x is cut short"
    damaged = {}
    assert loop._check_with_critic(tmp_path) is None
