"""``python -m hpcrl.inference.join RUN_DIR [--rank auto|N] [--sbatch]``: one more inference server for a RUNNING run.

Run it where the server should run: on a node of your own (inside ``salloc`` or an sbatch job), or on the run's
machine. It becomes the same server worker the run's own servers are (``python -m hpcrl.inference.worker``), under
a rank of its own, and the controller's server pool takes it in once it has registered and loaded the current
weights. It:

1. reads the run's ``config.yaml`` and refuses (one line, exit 2) a run that cannot take a server: one with
   ``train.weight_sync`` other than ``disk`` (a joining server loads the weights of the last disk export; the
   distributed sync's process group has a fixed world), one whose fleet is not elastic
   (``allocation.server.min_workers`` null), or one with no controller running (``RUN_DIR/controller-lease.json``
   missing, or naming a controller process that has ended on this node);
2. claims a rank no other server of the run uses (``hpcrl/launch/claims.py``, ``RUN_DIR/joins/server-<rank>``):
   the first free one from ``allocation.server.workers`` on (``--rank auto``, the default), or ``--rank N``;
3. execs the worker in its place, with the environment a scheduler gives a server worker: the run directory, its
   rank, a port slot of the run's, and a lease on the controller named in ``controller-lease.json``, so that the server
   ends when that controller is gone, as the run's own do. Its output goes to ``RUN_DIR/logs/server-<rank>.log``.
   Being the worker itself (exec keeps the pid), it is what Slurm's or your signals reach: SIGTERM stops the
   server and unregisters it.

``--sbatch`` prints, and does not submit, a batch script that runs this command with the Slurm resources of one
server of the run (``cluster.roles.server``: partition, qos, time, GPUs, ``extra_sbatch`` such as ``--requeue``,
the ``setup`` lines)::

    python -m hpcrl.inference.join RUN_DIR --sbatch | sbatch

Its port slot: one of the run's server slots (rank modulo ``allocation.server.workers``), not one past the run's
slots: ``HPCRL_PORT_WORLD`` cuts the whole port range, so a slot past the run's world would need a larger world,
whose slices would overlap the run's own. The ports of a slot are probed before use, so the joined server never
takes one a listener of the run holds; on the same node it shares its slice with that one server of the run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from hpcrl.config.load import load_run_config
from hpcrl.config.schema import Config
from hpcrl.controller.roles import server_spec
from hpcrl.errors import UserError, exit_on_user_error
from hpcrl.launch.base import RoleSpec, worker_env
from hpcrl.launch.claims import Claim, claim_first_free, claim_path, try_claim
from hpcrl.launch.controller_file import FILE, ControllerFile, read_controller_file
from hpcrl.launch.lease import with_lease
from hpcrl.launch.slots import RANK_ENV, SLOT_ENV, PortSlots
from hpcrl.launch.slurm.resources import role_resources, sbatch_lines, sbatch_quote
from hpcrl.rundir import RunDir

ROLE = "server"
JOINS = "joins"  # RUN_DIR/joins/server-<rank>: who holds each joined rank
AUTO = "auto"


class JoinRefused(UserError):
    """The run cannot take a server now: the message says which setting or state, and why."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hpcrl.inference.join", description=__doc__.split("``: ", 1)[1].split("\n")[0]
    )
    p.add_argument(
        "run_dir", type=Path, help="the running run's directory (with config.yaml and controller-lease.json)"
    )
    p.add_argument(
        "--rank", default=AUTO, type=_rank, metavar="auto|N", help="the server rank to take (auto: the first free one)"
    )
    p.add_argument("--sbatch", action="store_true", help="print an sbatch script that joins a server; submit nothing")
    return p.parse_args(argv)


def _rank(text: str) -> int | None:
    if text == AUTO:
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected {AUTO} or an integer >= 0, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run_dir = RunDir(args.run_dir.absolute())
        cfg = load_run_config(run_dir.config_file)
        controller = check_joinable(cfg, run_dir)
        if args.sbatch:
            print(sbatch_script(cfg, run_dir, sys.executable), end="")
            return 0
        claim = claim_rank(run_dir, cfg.allocation.server.workers, args.rank)
    except UserError as e:
        exit_on_user_error(e)
    exec_worker(server_spec(cfg).argv, join_env(cfg, run_dir, controller, claim.rank), run_dir, claim.rank)


def check_joinable(cfg: Config, run_dir: RunDir) -> ControllerFile:
    """The run's controller, when the run can take a server now; else ``JoinRefused`` naming what stops it."""
    if cfg.train.weight_sync != "disk":
        raise JoinRefused(
            f"train.weight_sync={cfg.train.weight_sync}: a server joins only a run with train.weight_sync=disk, "
            "whose weights it loads from the last export (the distributed sync's process group has a fixed world)"
        )
    if cfg.allocation.server.min_workers is None:
        raise JoinRefused(
            "allocation.server.min_workers is null: the run's fleet is not elastic, so it takes no servers that "
            "join; start the run with allocation.server.min_workers set"
        )
    return live_controller(run_dir)


def live_controller(run_dir: RunDir) -> ControllerFile:
    """The controller ``RUN_DIR/controller-lease.json`` names, unless it is known to have ended."""
    no_controller = f"no controller is running for {run_dir.path}"
    try:
        found = read_controller_file(run_dir.path)
    except ValueError as e:
        raise JoinRefused(f"{no_controller}: {e}") from None
    if found is None:
        raise JoinRefused(f"{no_controller}: it has no {FILE}, which its controller writes as it starts")
    if found.alive() is False:
        raise JoinRefused(f"{no_controller}: its controller (pid {found.pid} on {found.host}, {FILE}) has ended")
    return found


def claim_rank(run_dir: RunDir, workers: int, wanted: int | None) -> Claim:
    """A server rank for this process: ``wanted``, or the first free one from ``workers`` (the run's own are
    0..workers-1)."""
    directory = run_dir.path / JOINS
    if wanted is None:
        try:
            return claim_first_free(directory, ROLE, workers)
        except RuntimeError as e:
            raise JoinRefused(str(e)) from None
    if wanted < workers:
        raise JoinRefused(
            f"--rank {wanted} is a server of the run's own (allocation.server.workers={workers} has ranks "
            f"0..{workers - 1}): a joining server takes a rank >= {workers}, or --rank auto"
        )
    won, held = try_claim(directory, ROLE, wanted)
    if not won:
        raise JoinRefused(
            f"--rank {wanted} is taken: {held.describe()} holds it ({claim_path(directory, ROLE, wanted)}); "
            "pick another --rank or --rank auto (or remove that file if its process is gone)"
        )
    return held


def join_env(cfg: Config, run_dir: RunDir, controller: ControllerFile, rank: int) -> dict[str, str]:
    """The worker's whole environment: this one's, and what a scheduler gives a server worker (``worker_env``,
    its rank, the lease on ``controller``), with a port slot of the run's (``join_slot``)."""
    slots = controller.slots
    spec = with_lease(server_spec(cfg), controller.controller, controller.lease_s)
    return {
        **os.environ,
        **worker_env(run_dir.path, spec, slots),
        RANK_ENV: str(rank),
        SLOT_ENV: str(join_slot(slots, rank)),
    }


def join_slot(slots: PortSlots, rank: int) -> int:
    """The port slot of a joined server rank: one of the run's server slots, as the module doc says why."""
    return slots.slot(ROLE, rank % slots.counts[ROLE])


def exec_worker(argv: list[str], env: dict[str, str], run_dir: RunDir, rank: int) -> NoReturn:
    """Become the server worker, its output (this process's stdout and stderr) in ``logs/server-<rank>.log``."""
    log_file = run_dir.log_file(ROLE, rank)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    print(f"hpcrl: joining {run_dir.path} as server {rank} (pid {os.getpid()}); its log: {log_file}", flush=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.execvpe(argv[0], argv, env)


def sbatch_script(cfg: Config, run_dir: RunDir, python: str) -> str:
    """A batch script that joins one server to the run in ``run_dir``, with the Slurm resources of one server."""
    spec: RoleSpec = replace(server_spec(cfg), workers=1, nodes=1)
    resources = role_resources(spec, cfg.cluster, f"hpcrl-{cfg.run.experiment}-join")
    out = run_dir.logs / "join-%j.out"  # this command's own lines; the worker's go to logs/server-<rank>.log
    command = shlex.join([python, "-m", "hpcrl.inference.join", str(run_dir.path), "--rank", AUTO])
    lines = [
        "#!/bin/bash",
        f"# hpcrl: one more inference server for the running run in {run_dir.path}.",
        f"# Rendered by `python -m hpcrl.inference.join {shlex.quote(str(run_dir.path))} --sbatch`; submit it with "
        "`... | sbatch`.",
        f"#SBATCH --output={sbatch_quote(str(out))}",
        "#SBATCH --open-mode=append",
        *sbatch_lines(resources),  # after --output: an extra_sbatch --output of the role's wins
    ]
    for what, setup in (("cluster.setup", cfg.cluster.setup), ("cluster.roles.server.setup", resources.setup)):
        if setup:
            lines += ["", f"# {what}", *setup]
    return "\n".join([*lines, "", f"exec {command}", ""])


if __name__ == "__main__":
    raise SystemExit(main())
