"""``python -m hpcrl.sbatch controller|hetjob [--dry-run] [--write FILE] [--python PY] [--config-dir DIR] [overrides]``

Renders a batch script for the run the overrides describe (the same config ``python -m hpcrl.main``
composes and checks) and submits it with sbatch:

    controller   the controller as one Slurm job, which submits the workers (as -m hydra/launcher=submitit_slurm)
    hetjob       the whole run as one heterogeneous job: the controller and a component per role (servers,
                 trainers, the critic with algorithm=ppo, rollout workers), scheduled together

--dry-run prints the script and the sbatch command and submits nothing; --write FILE writes the script
there and submits nothing (slurm/*.sbatch are made this way). A bad config, or no sbatch on this machine's PATH,
exits 2 with one line before anything is written or submitted; a script sbatch refuses (or does not answer for)
is one line too, exit 2, and kept to inspect. ``--config-dir DIR`` (your own groups, e.g.
DIR/cluster/mysite.yaml) is searched after hpcrl's, as by ``python -m hpcrl.main --config-dir DIR``, and the script
passes it on to the run.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hpcrl.config.errors import ConfigError
from hpcrl.config.hydra import compose_config
from hpcrl.config.overrides import expand_allocation_shorthand, imply_group_options
from hpcrl.errors import UserError, exit_on_user_error
from hpcrl.launch.slurm.hetjob import SBATCH_TIMEOUT_S, submit_script
from hpcrl.launch.slurm.scripts import controller_script, run_hetjob_script, write_script

KINDS = ("controller", "hetjob")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.sbatch", description=__doc__.split("\n\n")[1])
    parser.add_argument("kind", choices=KINDS, help="what the script runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m hpcrl.main")
    parser.add_argument("--dry-run", action="store_true", help="print the script and the command; submit nothing")
    parser.add_argument("--write", type=Path, help="write the script to this file; submit nothing")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the job runs (default: this one)")
    parser.add_argument(
        "--config-dir", "-cd", type=Path, action="append", default=[], help="a directory of config groups of your own"
    )
    parser.add_argument("--verbose", action="store_true", help="a traceback for errors of the input too")
    return parser.parse_intermixed_args(argv)  # options may come after the overrides


def render(kind: str, overrides: list[str], python: str, config_dirs: Sequence[Path] = ()) -> str:
    """The script for ``kind``; ``ConfigError`` for a bad config, as ``hpcrl.main`` reports it."""
    dirs = [d.expanduser().absolute() for d in config_dirs]
    overrides = imply_group_options(expand_allocation_shorthand(overrides))
    cfg = compose_config(overrides, config_dirs=dirs)
    overrides = [*(f"--config-dir={d}" for d in dirs), *overrides]  # the run composes from the same directories
    if cfg.cluster.kind != "slurm":
        raise ConfigError("cluster.kind", cfg.cluster.kind, "slurm for a batch script (e.g. cluster=slurm_local)")
    name = f"hpcrl-{cfg.run.experiment}"
    if kind == "controller":
        return controller_script(cfg.cluster, name, overrides, python)
    from hpcrl.controller.roles import role_specs

    return run_hetjob_script(cfg.cluster, name, role_specs(cfg), overrides, python)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        make(args)
    except UserError as e:  # a bad config, no sbatch here, a script sbatch refuses: one line, exit 2
        exit_on_user_error(e, args.verbose)


def make(args: argparse.Namespace) -> None:
    """Render the script, then print it (--dry-run), write it (--write) or submit it."""
    text = render(args.kind, args.overrides, args.python, args.config_dir)
    if args.write:
        print(f"wrote {write_script(text, args.write)}")
        return
    path = Path.cwd() / f"hpcrl-{args.kind}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    if args.dry_run:
        print(text, end="")
        print(f"# would run: sbatch {shlex.quote(str(path))}  (--dry-run: nothing written or submitted)")
        return
    job_id = submit(text, path)
    print(f"submitted Slurm job {job_id}: sbatch {shlex.quote(str(path))}; its output: hpcrl-{job_id}.out")


def submit(text: str, path: Path) -> str:
    """Write the script to ``path`` and submit it; its job id. Without sbatch on PATH nothing is written
    (``UserError``); a script sbatch refuses, or does not answer for, is a ``UserError`` and stays to inspect."""
    if shutil.which("sbatch") is None:
        raise UserError(
            "sbatch is not on PATH here, so nothing was written or submitted",
            "run this where Slurm's commands are (a login node of the cluster); --dry-run or --write FILE shows the "
            "script anywhere",
        )
    try:
        return submit_script(write_script(text, path))
    except RuntimeError as e:  # sbatch's refusal, which names the script it kept
        raise UserError(" ".join(str(e).split())) from e
    except subprocess.TimeoutExpired as e:
        raise UserError(
            f"sbatch {path} did not answer within {SBATCH_TIMEOUT_S:g} s; the job may or may not be queued "
            "(squeue --me) and the script is kept there",
            "is slurmctld up? scontrol ping",
        ) from e


if __name__ == "__main__":
    main()
