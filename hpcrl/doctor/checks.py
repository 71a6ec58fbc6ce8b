"""The doctor's checks in order, from the overrides a run would get to one ``Result`` per line.

    overrides -> load_config (as ``hpcrl.main`` and ``hpcrl.sbatch`` check them: ``compose_config``) -> a config
                 line; a bad config stops here (``python -m hpcrl.doctor`` exits 2 with hpcrl.main's one line)
    local       run root, address, ports, setup timeouts                        (local.py)
    kind=local  the GPU checks on this machine, or why they do not apply        (gpu.py)
    kind=slurm  sbatch --test-only of every job                                 (testonly.py)
                probe jobs on compute nodes: network, run root, GPUs            (nodes.py; none with --no-jobs)
                without sbatch, squeue or scancel here: one fail line instead of these two (slurm_absent)

Results are yielded as they are made, so a slow Slurm check does not hold back the lines before it.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config import ConfigError, format_spec
from hpcrl.config.hydra import compose_config
from hpcrl.config.schema import Config
from hpcrl.doctor.gpu import gpu_checks_here, not_applicable
from hpcrl.doctor.local import local_checks, run_root
from hpcrl.doctor.nodes import node_checks
from hpcrl.doctor.report import Result, fail, ok, skip
from hpcrl.doctor.testonly import sbatch_checks


@dataclass(frozen=True)
class Options:
    job_prefix: str = "hpcrl-doctor-"  # starts the name of every job the doctor submits
    job_timeout_s: float = 300.0  # deadline of the probe jobs, from submission: queue time and run time
    python: str = sys.executable  # the interpreter the probe jobs run
    probe_jobs: bool = True  # submit the probe jobs (network, run root on nodes, gpu); False: --no-jobs


def load_config(overrides: list[str], config_dirs: Sequence[Path] = ()) -> Config:
    """The checked config ``python -m hpcrl.main [--config-dir DIR] OVERRIDES`` would run; ConfigError for a bad one."""
    return compose_config(overrides, config_dirs=[d.expanduser().absolute() for d in config_dirs])


def run_checks(config: Config | list[str], options: Options) -> Iterator[Result]:
    """The checks of a config, or of the one ``overrides`` make (a bad one: a failed config line, and no more)."""
    if isinstance(config, Config):
        cfg = config
    else:
        try:
            cfg = load_config(config)
        except ConfigError as e:
            text = " ".join(str(e).split())  # Hydra's messages span lines
            advice = "fix that value (docs/config.md lists every field); the other checks need a valid config"
            yield fail("config", text, advice)
            return
    c = cfg.cluster
    spec = format_spec(cfg.allocation.roles())
    yield ok("config", f"valid: allocation {spec} on cluster {c.name} ({c.kind}), run root {run_root(cfg)}")
    yield from local_checks(cfg)
    gpu_not_applicable = not_applicable(cfg)
    if c.kind != "slurm":
        if gpu_not_applicable is not None:
            yield gpu_not_applicable
        else:
            yield from gpu_checks_here(cfg, options.python, options.job_timeout_s)
        yield skip("slurm", f"cluster.kind={c.kind}: no sbatch checks and no probe jobs")
        return
    probed = ["network", "run root on nodes", *(["gpu"] if gpu_not_applicable is None else [])]
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if missing:
        yield slurm_absent(missing, probed)
    else:
        yield from sbatch_checks(cfg, options.job_prefix, options.python, run_root(cfg) / ".hpcrl-doctor" / "test-only")
        if options.probe_jobs:
            yield from node_checks(cfg, options.job_prefix, options.job_timeout_s, options.python)
        else:
            yield skip("compute nodes", f"--no-jobs: no probe job submitted; not checked: {', '.join(probed)}")
    if gpu_not_applicable is not None:
        yield gpu_not_applicable


SLURM_COMMANDS = ("sbatch", "squeue", "scancel")  # what the Slurm checks call (sacct and sinfo only add detail)


def slurm_absent(missing: list[str], probed: list[str]) -> Result:
    """The one line for a machine where Slurm's commands are not on PATH: what is missing, and what is not checked."""
    found = f"{', '.join(missing)} not on PATH" if len(missing) < len(SLURM_COMMANDS) else "no Slurm commands on PATH"
    return fail(
        "slurm",
        f"cluster.kind=slurm, but {found} here: no sbatch checks and no probe jobs (not checked: {', '.join(probed)})",
        "run the doctor on a login node of the cluster, where sbatch, squeue and scancel are, or pick a local "
        "cluster (cluster=local) to run on this machine",
    )
