"""The worker registry: a worker that leaves forgets its own entry, never a replacement's."""

from hpcrl.launch.registry import Entry, Registry


def test_a_leaving_worker_removes_its_own_entry_but_not_a_replacements(tmp_path):
    registry = Registry(tmp_path)
    old = Entry("server", 1, "10.0.0.2", 5000, pid=100, node="n2")
    registry.register(old)
    registry.register(Entry("server", 1, "10.0.0.4", 5001, pid=200, node="n4"))  # replaced while old was cut off
    registry.unregister_own(old)  # the old worker ends at last (its lease ran out) on a filesystem it still sees
    assert [(e.pid, e.node) for e in registry.entries("server")] == [(200, "n4")]
    new = registry.entries("server")[0]
    registry.unregister_own(new)
    assert registry.entries("server") == []
    registry.unregister_own(new)  # gone already: nothing to do
