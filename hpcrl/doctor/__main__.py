"""``python -m hpcrl.doctor [--no-jobs] [--job-prefix P] [--job-timeout-s S] [--config-dir DIR] [overrides]``: preflight
a cluster.

Takes the overrides ``python -m hpcrl.main`` would get (and its ``--config-dir``) and prints one line per check
(``ok|warn|fail|skip  <check>: <what was found>; <what to do>``); exits 1 when any check fails. A config that
``python -m hpcrl.main`` would refuse is refused the same way, before any check: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcrl.doctor.checks import Options, load_config, run_checks
from hpcrl.doctor.report import exit_code
from hpcrl.errors import UserError, exit_on_user_error
from hpcrl.launch.process import ChildGroup
from hpcrl.logs import setup_logging


def parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = Options()
    parser = argparse.ArgumentParser(prog="python -m hpcrl.doctor", description=__doc__.split("\n\n")[1])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m hpcrl.main")
    parser.add_argument("--job-prefix", default=defaults.job_prefix, help="start of the probe jobs' names")
    parser.add_argument(
        "--job-timeout-s", type=float, default=defaults.job_timeout_s, help="deadline of the probe jobs, queue included"
    )
    parser.add_argument("--python", default=defaults.python, help="the interpreter the probe jobs run")
    parser.add_argument(
        "--no-jobs",
        dest="probe_jobs",
        action="store_false",
        help="submit no probe job: every check but network, run root on nodes and gpu (sbatch --test-only queues "
        "nothing)",
    )
    parser.add_argument(
        "--config-dir", "-cd", type=Path, action="append", default=[], help="a directory of config groups of your own"
    )
    return parser.parse_intermixed_args(argv)  # options may come after the overrides


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    options = Options(args.job_prefix, args.job_timeout_s, args.python, args.probe_jobs)
    setup_logging("doctor", 0, "WARNING")  # hpcrl's own warnings (e.g. about the port range), as a run logs them
    try:
        cfg = load_config(args.overrides, args.config_dir)
    except UserError as e:  # a bad config: hpcrl.main's one line, exit 2
        exit_on_user_error(e)
    results = []
    # SIGTERM and Ctrl-C become exceptions, so the probe jobs are cancelled on the way out
    try:
        with ChildGroup():
            for result in run_checks(cfg, options):
                print(result.line(), flush=True)
                results.append(result)
    except KeyboardInterrupt:
        print("hpcrl doctor: interrupted; its probe jobs are cancelled", file=sys.stderr)
        sys.exit(130)
    sys.exit(exit_code(results))


if __name__ == "__main__":
    main()
