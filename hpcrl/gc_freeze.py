"""Keep the start-up heap out of Python's full garbage collections.

A process of this package holds several hundred thousand long-lived objects once it has started (torch's and
transformers' modules, the model's Python objects, the dataset's rows, Hydra's config). CPython's oldest
generation is collected whenever the objects that survived younger collections reach a quarter of it, and each
such collection walks every tracked object: 0.15-0.3 s on this project's 2-core machine, in the controller
every few seconds of a run, during which its event loop answers nothing (and a trainer rank's pause stalls
every other rank at the next collective). ``gc.freeze()`` after start-up moves those objects to the permanent
generation, which no collection walks; what the run allocates later is collected as before. SGLang 0.5.23
does the same in each of its processes after its warm-up (``/freeze_gc``). Cycles among the frozen objects
are never freed, so freeze once, after start-up, what lives until exit.

A worker process (a server, a trainer rank) also pauses the collector from its start until that freeze
(``pause_until_frozen``): its start-up (importing torch and transformers, 600 thousand objects, then loading the
model) allocates what lives until exit, and the full collections that growth triggers on the way walked the
heap six times to free a few hundred objects, 0.5-1 s of each process's CPU here. Reference counting frees
everything else as before; the freeze's own collection frees the start-up's few cycles.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def pause_until_frozen() -> None:
    """Switch the cyclic collector off until ``freeze_startup_heap`` switches it on; for a process that calls that
    once it has started, or exits."""
    gc.disable()


def freeze_startup_heap(who: str) -> int:
    """Collect the start-up garbage, then freeze every object still alive, and collect (again) what comes later;
    return how many were frozen."""
    gc.collect()
    gc.freeze()
    gc.enable()  # after pause_until_frozen
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of the garbage collector's full collections", who, frozen)
    return frozen
