"""The controller job's launcher: what ``-m hydra/launcher=submitit_slurm`` selects, hpcrl's settings on submitit's.

``python -m hpcrl.main -m hydra/launcher=submitit_slurm cluster=SITE ...`` runs the controller (the same command
without -m) as one Slurm job, sized by the cluster group's ``controller``, whose partition, account, qos,
constraint and extra_sbatch win over the cluster's, with the cluster's setup. ``python -m hpcrl.sbatch controller``
renders the same job as a script (hpcrl/launch/slurm/scripts.py; tests/slurm/test_sbatch.py holds the two equal).
The submitting command waits for that job; its stdout and stderr are in ``<run dir>/.submitit/<job id>/``.

The submitit plugin stores its own option under that name in Hydra's ConfigStore (its schema, ``SlurmQueueConf``).
``register_launcher`` merges ``SETTINGS`` onto that schema and stores the result under the same name, in its
place: every other field keeps the plugin's type and default, and ``hydra.launcher.FIELD=...`` still overrides
any of them. A YAML file of that name in conf/ did this through Hydra's "automatic schema matching", deprecated
since Hydra 1.1, which warned three times on every submitit call (once per composition).
"""

from __future__ import annotations

import shutil
from typing import Any

from hpcrl.errors import UserError

GROUP, NAME = "hydra/launcher", "submitit_slurm"

SETTINGS: dict[str, Any] = {
    "name": "hpcrl-${run.experiment}",
    # the controller's own settings, else the cluster's (hpcrl.controller: controller_resources, as the sbatch script)
    "partition": "${hpcrl.controller:${cluster},partition}",
    "timeout_min": "${hpcrl.first:${cluster.controller.time_min},${cluster.time_min}}",  # minutes, >= 2
    "cpus_per_task": "${cluster.controller.cpus}",
    "mem_gb": "${hpcrl.gib:${cluster.controller.mem_gb}}",
    "account": "${hpcrl.controller:${cluster},account}",
    "qos": "${hpcrl.controller:${cluster},qos}",
    "constraint": "${hpcrl.controller:${cluster},constraint}",
    "additional_parameters": "${hpcrl.controller:${cluster},additional}",
    "setup": ["${hpcrl.lines:${cluster.setup}}"],  # one string of lines: a list field takes no interpolation here
    # Slurm sends the job USR2 this many seconds before its time limit (the plugin's 120 s would signal a job of
    # 2 minutes at once), or when it is preempted: the controller checkpoints, and submitit requeues the job
    # (at the time limit at most max_num_timeout times), which resumes (hpcrl/controller/preempt.py)
    "signal_delay_s": "${cluster.controller.signal_delay_s}",
    "max_num_timeout": "${cluster.controller.max_requeues}",
}


def register_launcher() -> None:
    """Store the controller job's launcher option in place of the plugin's; nothing without the plugin."""
    try:
        from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    except ImportError:
        return
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    from omegaconf import OmegaConf

    # Hydra runs every plugin module again when it first scans them, once per process, and the plugin's module
    # stores its own option as it runs: scanned now, so that it cannot replace this one later
    Plugins.instance()
    node = OmegaConf.merge(OmegaConf.structured(SlurmQueueConf), SETTINGS)
    ConfigStore.instance().store(group=GROUP, name=NAME, node=node, provider="hpcrl")


def check_slurm_here(target: str) -> None:
    """Before a launcher with ``_target_`` ``target`` submits: a ``UserError`` when it is submitit's Slurm launcher
    and this machine lacks sbatch or srun (submitit calls both as it starts), so that no traceback of submitit's
    says it."""
    if not target.endswith(".SlurmLauncher"):
        return
    missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
    if missing:
        raise UserError(
            f"hydra/launcher={NAME} submits the controller as a Slurm job, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH here: nothing was submitted",
            "run it on a login node of the cluster (python -m hpcrl.doctor checks one), or add run.dry_run=true to "
            "see what it would submit",
        )
