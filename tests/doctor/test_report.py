"""The doctor's output: one line per check, and its exit code."""

import pytest

from hpcrl.doctor.report import Result, exit_code, fail, ok, skip, warn


def test_a_line_says_status_check_found_and_advice():
    assert fail("ports", "in use", "move the range").line() == "fail  ports: in use; move the range"
    assert ok("config", "valid").line() == "ok    config: valid"
    assert skip("gpu", "a CPU cluster").line() == "skip  gpu: a CPU cluster"


def test_what_a_tool_printed_on_several_lines_is_one_line():
    assert fail("sbatch x", "error: a\nerror: b\n", "fix\nit").line() == "fail  sbatch x: error: a | error: b; fix | it"


def test_only_a_failed_check_makes_the_exit_code_non_zero():
    assert exit_code([ok("a", ""), warn("b", "", ""), skip("c", "")]) == 0
    assert exit_code([ok("a", ""), fail("b", "", "")]) == 1


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="ok, warn, fail, skip"):
        Result("good", "a", "b")
