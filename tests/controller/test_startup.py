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


def test_the_controller_reaches_its_workers_start_without_importing_torch():
    """What the controller imports before it starts the workers (the command, its config and preflight, the job's
    preparation and the schedulers) leaves torch out: torch comes with the loop's modules once the workers are
    starting (``job.import_the_loop``), so its 2-3 s of imports overlap theirs. A module-level torch import on that
    path (the loop, the trainers' client, the tiny model cache's key) fails this."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import hpcrl.main, hpcrl.config.preflight, hpcrl.data, hpcrl.launch.local, hpcrl.launch.slurm\n"
        "from hpcrl.controller.eval_only import run_eval_only\n"
        "from hpcrl.controller.job import prepare_model, prepare_rows, run_job\n"
        "from hpcrl.models import tiny_cache\n"
        "tiny_cache.entry_key({'seed': 0}, [])\n"
        "print('torch' in sys.modules)\n"
        "from hpcrl.controller.job import import_the_loop\n"
        "import_the_loop()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
