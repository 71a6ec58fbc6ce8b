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
