"""Flush subnormal floats to zero in a process that computes with torch on the CPU (a trainer or critic rank, a CPU
server).

A float32 below 1.2e-38 is subnormal, and x86 cores compute with one tens of times slower than with a normal
number. Training can make them (Adam's second moment of a parameter whose gradients are tiny: a squared 1e-20 is
1e-40; where they arose here was not traced). On this project's 2-core machine one seed of the default job
(``bench/trl_grpo.py`` seed 0) stepped in 0.88 s instead of about 0.45 s, its trainer's updates 2.5x and its
server's generation 1.7x slower with the same tokens a step; with subnormals flushed (the CPU's flush-to-zero and
denormals-are-zero modes, ``torch.set_flush_denormal``) it stepped at the other seeds' pace. Flushing changes the
arithmetic in the last bits, so a run's trajectory may move a little (one seed of eight reached a mean reward of
0.8 at step 130 instead of 119). A value that small is below bf16's smallest normal too (the same 1.2e-38). It
changes nothing on a GPU.
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
