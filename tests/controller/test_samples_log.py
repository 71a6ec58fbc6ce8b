"""A few prompts with their completions and rewards, every ``metrics.samples_every_steps`` steps: ``samples.jsonl``
and TensorBoard's text, never ``metrics.jsonl``; a resumed run cuts them back like its metrics."""

import json

from hpcrl.config.schema import MetricsConfig
from hpcrl.controller.metrics import MetricsLog, read_metrics, sample_rows
from hpcrl.rollout.workflows.base import Group, Sample


def group(prompt: str, texts: list[str], rewards: list[float | None]) -> Group:
    samples = [Sample([1], [0.0], [0], "stop", text=t, reward=r) for t, r in zip(texts, rewards, strict=True)]
    return Group(prompt, "7", [3, 4], samples)


def test_sampled_completions_go_to_samples_jsonl_and_tensorboard_not_to_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    groups = [group("3+4=", ["7", "1|2"], [1.0, None]), group("1+1=", ["2", "3"], [1.0, 0.0]), group("x", ["y"], [0])]
    rows = sample_rows(groups, 2)
    assert [r["prompt"] for r in rows] == ["3+4=", "1+1="], "the batch's first groups"
    assert rows[0]["completions"] == [
        {"text": "7", "reward": 1.0, "finish_reason": "stop"},
        {"text": "1|2", "reward": None, "finish_reason": "stop"},
    ]
    log = MetricsLog(tmp_path, settings=MetricsConfig(loggers=["tensorboard"]))
    log.log(1, {"reward_mean": 0.5, "samples": rows})
    log.log(2, {"reward_mean": 0.6})
    log.close()
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert metrics == [{"step": 1, "reward_mean": 0.5}, {"step": 2, "reward_mean": 0.6}]
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, **rows[0]}, {"step": 1, **rows[1]}]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (text,) = events.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 1 and "| 3+4= | 7 | 1\\|2 | None |" in table, table

    # a run resumed from step 0 trains step 1 again: its samples are dropped with its metrics line
    resumed = MetricsLog(tmp_path, keep_until=0, settings=MetricsConfig(loggers=[]))
    resumed.close()
    assert (tmp_path / "samples.jsonl").read_text() == ""
