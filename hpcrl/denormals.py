"""Flush subnormal floats to zero in a process that computes with torch on the CPU (a trainer or critic rank, a CPU
server).

A float32 below 1.2e-38 is subnormal, and x86 cores compute with one tens of times slower than with a normal
number. Training makes them: Adam's second moment of a parameter whose gradients are tiny (a squared 1e-20 is
1e-40), and what flows from it. On this project's 2-core machine one seed of the default job (``bench/trl_grpo.py``
seed 0) stepped in 0.88 s instead of 0.42 s, its trainer's updates 2.5x and its server's generation 1.7x slower,
all of it subnormal arithmetic: with subnormals flushed (the CPU's flush-to-zero and denormals-are-zero modes,
``torch.set_flush_denormal``) the same run took the same steps with the same rewards at the other seeds' pace. A
value that small is far below what float32 training or sampling resolves (bf16's smallest normal is the same
1.2e-38), so nothing measurable is lost; XLA does the same on CPUs by default. It changes nothing on a GPU.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def flush_denormals() -> bool:
    """Have this process's CPU threads treat subnormal floats as zero (torch applies it to the threads it starts
    from now on); False where the CPU cannot (no SSE3), which then computes as before."""
    import torch

    flushed = torch.set_flush_denormal(True)
    if not flushed:
        log.info("this CPU cannot flush subnormal floats to zero: they are computed as such (slower)")
    return flushed
