"""bench/_jobs.py: the table every script prints, and reading a metrics file being written."""

import json

from _jobs import read_metrics, table


def test_table_pads_columns_and_right_aligns_numbers():
    out = table(["name", "value"], [["a", 1.5], ["longer", 1234.0], ["c", ""]]).splitlines()
    assert out[0] == "| name   | value |"
    assert out[1] == "|--------|-------|"
    assert out[2] == "| a      |   1.5 |"
    assert out[3] == "| longer |  1234 |"
    assert out[4] == "| c      |       |"


def test_metrics_stop_at_a_line_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "rew')
    assert read_metrics(path) == [{"step": 1}]
    assert read_metrics(tmp_path / "absent.jsonl") == []


def test_cpu_seconds_a_step_run_from_the_first_logged_step_to_the_one_asked():
    from pathlib import Path

    from _jobs import JobResult

    samples = [(0.0, 5.0, 0), (1.0, 9.0, 1), (1.5, 10.0, 3), (2.0, 11.5, 5), (2.5, 12.0, 6)]
    job = JobResult(Path("."), 3.0, None, cpu=samples)
    assert job.cpu_s_per_step(5) == (11.5 - 9.0) / (5 - 1), "start-up's CPU (before step 1) is left out"
    assert job.cpu_s_per_step(4) == job.cpu_s_per_step(5), "the first sample at or past the step"
    assert str(job.cpu_s_per_step(7)) == "nan" and str(JobResult(Path("."), 0.0, None).cpu_s_per_step(1)) == "nan"
