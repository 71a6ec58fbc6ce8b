"""The run's progress where stderr is not a terminal: lines in the log, no bar."""

import logging
import os
import subprocess
import sys

import pytest

from hpcrl.controller.progress import Lines, Progress


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hpcrl.controller.progress"]


def test_away_from_a_terminal_no_bar_is_drawn_and_a_line_comes_every_tenth_of_the_run(capsys, caplog):
    caplog.set_level(logging.INFO, logger="hpcrl.controller.progress")
    with Progress(25) as progress:  # stderr is pytest's capture here, as it is a pipe or a file in a job
        for step in range(1, 26):
            progress.update(step, {"reward_mean": 0.5, "eval_accuracy": 0.25})
    # before, tqdm drew its bar into it: a line of carriage-return frames, one more per step
    assert capsys.readouterr().err == ""
    shares = [line.split(",")[0] for line in progress_lines(caplog)]
    assert shares == [f"progress: step {s} of 25 ({4 * s}%)" for s in (3, 6, 9, 12, 15, 18, 21, 24, 25)]


def test_a_line_gives_the_pace_since_the_first_step_seen_and_the_time_to_go(caplog):
    caplog.set_level(logging.INFO, logger="hpcrl.controller.progress")
    now = [0.0]
    lines = Lines(400, clock=lambda: now[0])
    assert lines.every == 40
    for step in range(1, 401):  # step k ends at 3 k s: 3 s a step
        now[0] = 3.0 * step
        lines.update(step, {})
    got = progress_lines(caplog)
    assert got[0] == "progress: step 40 of 400 (10%), 3.00 s a step, about 18.0 min to go"
    assert got[-1] == "progress: step 400 of 400 (100%), 3.00 s a step, about 0 s to go"
    assert len(got) == 10


def test_a_resumed_run_counts_its_pace_from_its_first_step(caplog):
    caplog.set_level(logging.INFO, logger="hpcrl.controller.progress")
    now = [1000.0]  # the time before the resumed run's first step (loading, evaluation) does not count
    lines = Lines(20, clock=lambda: now[0])
    for step, at in ((11, 1010.0), (12, 1012.0), (14, 1018.0)):
        now[0] = at
        lines.update(step, {})
    assert progress_lines(caplog) == [
        "progress: step 12 of 20 (60%), 2.00 s a step, about 16 s to go",
        "progress: step 14 of 20 (70%), 2.67 s a step, about 16 s to go",
    ]


def bars_after_setup_logging(imported_first: str) -> str:
    """Whether transformers would draw its bars in a process whose stderr is a pipe, after hpcrl's setup_logging,
    with ``imported_first`` imported before it (the config's checks import datasets, and with it huggingface_hub)."""
    code = (
        f"import {imported_first}\n"
        "from hpcrl.logs import setup_logging\n"
        "setup_logging('controller', 0)\n"
        "from transformers.utils import logging\n"
        "print(logging.is_progress_bar_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("imported_first", ["os", "huggingface_hub", "transformers"])
def test_library_bars_are_off_where_stderr_is_not_a_terminal(imported_first):
    # before: "Writing model shards" and "Loading weights" bars in the controller's redirected stderr and in every
    # worker's log
    assert bars_after_setup_logging(imported_first) == "False"
