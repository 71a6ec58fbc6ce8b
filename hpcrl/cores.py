"""The CPU cores this process may run on, which the torch thread counts of a server or a rank are cut from."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process is allowed (its affinity: Slurm's cgroup or ``taskset``), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
