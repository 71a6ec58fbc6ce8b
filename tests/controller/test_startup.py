"""The start-up line: each phase's seconds from the end of the one before, the first from the command's start."""

import time

import psutil
import pytest

from hpcrl.controller.startup import Startup


def test_each_phase_is_timed_from_the_end_of_the_one_before():
    startup = Startup(began=100.0)
    startup.marks = [("python, imports, config", 103.25), ("data and model", 104.0), ("workers", 116.5)]
    assert startup.seconds() == pytest.approx(16.5)
    assert startup.line() == (
        "start-up took 16.5 s to the first step: python, imports, config 3.2 s, data and model 0.8 s, workers 12.5 s"
    )


def test_the_clock_starts_when_the_process_did():
    startup = Startup()
    assert startup.began == psutil.Process().create_time() <= time.time()
    startup.mark("now")
    assert startup.seconds() >= time.time() - psutil.Process().create_time() - 1.0
