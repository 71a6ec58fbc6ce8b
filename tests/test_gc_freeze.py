"""``freeze_startup_heap``: the start-up heap leaves the collector's generations; later objects and garbage do not."""

import subprocess
import sys

from tests.conftest import REPO

# in a process of its own: a frozen heap is for the life of the process, and this one is pytest's
PROBE = """
import gc, weakref
from hpcrl.gc_freeze import freeze_startup_heap

class Node:
    def __init__(self):
        self.me = self  # a cycle: only the cyclic collector frees it

startup = [Node() for _ in range(1000)]
garbage = Node()
garbage_ref = weakref.ref(garbage)
del garbage  # unreachable before the freeze: collected first, not frozen for good
frozen = freeze_startup_heap("probe")
later = Node()
tracked = {id(o) for o in gc.get_objects()}
print(frozen, sum(id(n) in tracked for n in startup), id(later) in tracked, garbage_ref() is None)
"""


def test_the_start_up_heap_is_frozen_and_what_comes_later_is_still_collected():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    frozen, startup_tracked, later_tracked, garbage_freed = out.stdout.split()
    assert int(frozen) > 1000  # the 1000 nodes and everything the imports made
    assert startup_tracked == "0"  # no generation (so no full collection) holds a start-up node any more
    assert later_tracked == "True"  # what the run allocates later is collected as before
    assert garbage_freed == "True"


PAUSED = """
import gc, weakref
from hpcrl.gc_freeze import freeze_startup_heap, pause_until_frozen

class Node:
    def __init__(self):
        self.me = self

pause_until_frozen()
before = gc.get_stats()[2]["collections"]
garbage = Node()
garbage_ref = weakref.ref(garbage)
del garbage
kept = [Node() for _ in range(100_000)]  # growth that would trigger collections of every generation
print(gc.isenabled(), gc.get_stats()[2]["collections"] - before, garbage_ref() is None, end=" ")
freeze_startup_heap("probe")
print(gc.isenabled(), garbage_ref() is None)
"""


def test_a_paused_collector_runs_no_collection_until_the_freeze_which_frees_the_garbage_and_resumes_it():
    out = subprocess.run([sys.executable, "-c", PAUSED], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0", "False", "True", "True"]


def test_the_server_and_the_trainer_rank_pause_the_collector_first():
    for module in ("hpcrl.inference.server.__main__", "hpcrl.train.worker"):
        source = (REPO / (module.replace(".", "/") + ".py")).read_text()
        main = source[source.index("\ndef main(") :]
        assert main.index("pause_until_frozen()") < main.index("setup_logging("), module
