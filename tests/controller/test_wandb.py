"""Weights & Biases as a logger beside TensorBoard (``metrics.loggers``, ``logger=wandb``): in offline mode a run's
metrics go, step by step, into ``<run dir>/wandb/offline-run-*/run-<id>.wandb``, read back here record by record;
the run id is the run directory's, so a resumed run logs to the same W&B run. And the controller's line per step."""

import json
import math
import time

import pytest

from hpcrl.config.schema import Config, MetricsConfig, WandbConfig
from hpcrl.controller.metrics import MetricsLog, step_line, wandb_run_id

wandb = pytest.importorskip("wandb")  # the dev extra installs it; skipped only where it is not installed

BLOCK, HEADER = 32768, 7  # the .wandb file is a LevelDB-style log: 32 KiB blocks of records with 7-byte headers
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path) -> list[bytes]:
    """The records of a .wandb file (its own header, ":W&B" and version, then LevelDB log records)."""
    data = path.read_bytes()
    if len(data) < 7:  # its header is not written yet
        return []
    assert data[:4] == b":W&B", "not a W&B data file"
    records, parts, pos = [], [], 7
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        parts.append(data[pos + HEADER : pos + HEADER + length])
        pos += HEADER + length
        if kind in (FULL, LAST):
            records.append(b"".join(parts))
            parts = []
    return records


def logged_history(run_dir, steps: int, deadline_s: float = 30.0) -> tuple[list[dict], dict]:
    """(each history record as {key: value}, the run record's fields) of the one offline run in ``run_dir``, once
    the file holds the run record and ``steps`` history records. W&B's service process writes the file: in a
    loaded test run the file held no record yet just after ``finish()`` returned, so it is read again until then."""
    deadline = time.monotonic() + deadline_s
    while True:
        history, run = _read_history(run_dir)
        if (run and len(history) >= steps) or time.monotonic() > deadline:
            return history, run
        time.sleep(0.2)


def _read_history(run_dir) -> tuple[list[dict], dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    (file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, run = [], {}
    for data in wandb_records(file):
        record = pb.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item  # a key is in .key or, as wandb 0.31 writes it, in .nested_key
            history.append({item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items})
        elif record.WhichOneof("record_type") == "run":
            run = {"id": record.run.run_id, "name": record.run.display_name, "project": record.run.project}
    return history, run


STEPS = [
    {"reward_mean": 0.25, "loss": 0.5, "time_step_s": 1.5, "staleness_mean": 0.0, "staleness_max": 0},
    {"reward_mean": 0.5, "loss": 0.25, "time_step_s": 1.25, "staleness_mean": 0.5, "staleness_max": 1},
    {"reward_mean": 0.75, "loss": float("nan"), "time_step_s": 1.0, "eval_accuracy": 0.6, "staleness_max": 1},
]


def test_metrics_go_to_an_offline_wandb_run_step_by_step(tmp_path):
    settings = MetricsConfig(loggers=["tensorboard", "wandb"], wandb=WandbConfig(project="hpcrl-test", tags=["t"]))
    metrics = MetricsLog(tmp_path, settings=settings, run_name="exp/trial", run_config=Config())
    completion = {"text": "2", "reward": 1.0, "finish_reason": "stop"}
    samples = [{"prompt": "1+1=", "answer": "2", "completions": [completion]}]
    for step, m in enumerate(STEPS, start=1):
        metrics.log(step, {**m, "samples": samples} if step == 2 else m)
    metrics.close()
    history, run = logged_history(tmp_path, len(STEPS))
    # step 2's samples, as a W&B table: one row per completion
    (table,) = tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json")
    assert json.loads(table.read_text()) == {"columns": ["prompt", "answer", "completion", "reward"],
                                             "data": [["1+1=", "2", "2", 1.0]]}  # fmt: skip
    assert run == {"id": wandb_run_id(tmp_path), "name": "exp/trial", "project": "hpcrl-test"}
    by_step = {h["_step"]: h for h in history}
    assert sorted(by_step) == [1, 2, 3]
    for step, m in enumerate(STEPS, start=1):
        finite = {k: v for k, v in m.items() if math.isfinite(v)}
        assert {k: by_step[step][k] for k in finite} == finite, step
    assert "loss" not in by_step[3], "a NaN is not sent"
    assert list((tmp_path / "tensorboard").iterdir()), "TensorBoard events as well"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_without_wandb_among_the_loggers_nothing_goes_to_wandb(tmp_path):
    metrics = MetricsLog(tmp_path, settings=MetricsConfig(loggers=[]))
    metrics.log(1, STEPS[0])
    metrics.close()
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "tensorboard").exists()


def test_a_resumed_run_has_the_same_wandb_run_id(tmp_path):
    assert wandb_run_id(tmp_path / "a") == wandb_run_id(tmp_path / "a") != wandb_run_id(tmp_path / "b")


def test_the_step_line_says_reward_accuracy_time_and_staleness():
    assert step_line(3, STEPS[2]) == "step 3: reward 0.750, accuracy 0.600, loss nan, 1.00 s, staleness 0.00 (max 1)"
    line = step_line(2, {**STEPS[1], "completion_len_mean": 2.0, "groups_rejected": 3})
    expected = "step 2: reward 0.500, loss 0.25, 1.25 s, staleness 0.50 (max 1), completion 2.0 tokens"
    assert line == f"{expected}, 3 groups rejected so far"


def test_the_step_line_says_the_rollout_trainer_mismatch():
    line = step_line(2, {**STEPS[1], "mismatch_abs_mean": 0.0123, "mismatch_abs_max": 0.5})
    assert line == "step 2: reward 0.500, loss 0.25, 1.25 s, staleness 0.50 (max 1), mismatch 0.0123 (max 0.5)"
