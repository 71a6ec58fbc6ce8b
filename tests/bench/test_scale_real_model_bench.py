"""bench/scale_real_model.py: the whole loop with a chat model of a given shape (tiny here), each process's peak
memory and the steps' times."""

import json
from types import SimpleNamespace

from tests.bench.conftest import assert_table


def test_scale_bench_prints_peak_memory_by_process_and_step_times(run_bench):
    out = run_bench("scale_real_model")
    memory = {row[0]: float(row[2]) for row in assert_table(out, "process", "count", "peak GiB")}
    assert {"controller", "inference server", "trainer rank 0", "trainer rank 1"} <= set(memory), out
    assert all(0 < gib < 8 for gib in memory.values()), memory
    steps = assert_table(out, "step", "rollout wait", "train", "weight sync")
    assert [row[0] for row in steps] == ["1", "2"]
    assert all(float(row[1]) >= float(row[3]) for row in steps), "a step holds its training"
    summary = json.loads(out.split("summary: ", 1)[1].splitlines()[0])
    assert summary["steps"] == 2 and summary["final_model"].endswith("/final")


class FakeProcess:
    """A process whose command line (its role) and resident set size the test sets."""

    def __init__(self, pid: int, children: list | None = None):
        self.pid, self.rss, self.kids = pid, 0, children or []

    def children(self, recursive: bool) -> list:
        return self.kids

    def memory_info(self) -> SimpleNamespace:
        return SimpleNamespace(rss=self.rss)


def test_a_child_sampled_between_its_fork_and_its_exec_counts_as_the_program_it_runs(monkeypatch):
    # the server worker forks the inference server: sampled before the exec, the child still reads as the worker
    # (the role was kept from the first sample, and the memory table had no inference server)
    import scale_real_model as bench

    child = FakeProcess(7)
    root = FakeProcess(1, [child])
    roles = {1: "controller", 7: "server worker"}
    monkeypatch.setattr(bench, "role_of", lambda p: roles[p.pid])
    peaks: dict = {}
    for role, rss in (("server worker", 300), ("inference server", 100), ("inference server", 200), ("?", 50)):
        roles[7], child.rss = role, rss
        bench.sample(root, peaks)
    assert peaks[7] == ("inference server", 200), "the forked copy's size is not the server's"
