"""The order of a weight push: a disk export runs while generation goes on, then one load call per server
aborts and loads (no pause and continue around it); a distributed push pauses for its session."""

import asyncio
import time
from pathlib import Path

from hpcrl.controller.weights import WeightSync


class Calls:
    """A client and trainers that record each call and whether generation was open (``resumed`` set) then."""

    def __init__(self, resumed: asyncio.Event):
        self.resumed = resumed
        self.seen: list[tuple[str, bool]] = []

    def _note(self, name: str) -> None:
        self.seen.append((name, self.resumed.is_set()))

    async def export_for_servers(self, path) -> None:
        self._note("export")
        path.mkdir(parents=True)

    async def pause(self, mode: str) -> None:
        assert mode == "abort"
        self._note("pause")

    async def update_weights_from_disk(self, path: str, version: int, *, abort_all_requests: bool = False) -> None:
        self._note(f"load v{version}" + (" aborting" if abort_all_requests else ""))

    async def resume(self) -> None:
        self._note("resume")

    async def begin_weight_update(self) -> None:
        self._note("begin")

    async def end_weight_update(self) -> None:
        self._note("end")

    async def push_weights(self, version: int, dtype: str) -> None:
        self._note(f"broadcast v{version}")


def test_a_disk_push_exports_while_generating_then_aborts_and_loads_in_one_call(tmp_path):
    weights = tmp_path / "weights"
    (weights / "v000000").mkdir(parents=True)  # an interrupted earlier run's export

    async def push_twice() -> tuple[list, WeightSync, list[str]]:
        resumed = asyncio.Event()
        resumed.set()
        calls = Calls(resumed)
        sync = WeightSync("disk", calls, calls, resumed, weights)  # type: ignore[arg-type]
        await sync.push(1)
        await sync.push(2)
        assert resumed.is_set(), "generation is open again after the push"
        await sync.close()  # awaits the deletion of the older exports
        return calls.seen, sync, sorted(p.name for p in weights.iterdir())

    seen, sync, left = asyncio.run(push_twice())
    one_push = [("export", True), ("load v{} aborting", False)]
    assert seen == [(name.format(v), open_) for v in (1, 2) for name, open_ in one_push], seen
    assert sync.current == (str(weights / "v000002"), 2)
    assert left == ["v000002"], "the older exports are deleted, an earlier run's too"


def test_a_distributed_push_pauses_for_its_session_and_resumes_after(tmp_path):
    async def push() -> list:
        resumed = asyncio.Event()
        resumed.set()
        calls = Calls(resumed)
        sync = WeightSync("distributed", calls, calls, resumed, tmp_path / "weights")  # type: ignore[arg-type]
        sync.buckets = []  # no tensors: the session's order is what is checked
        await sync.push(3)
        assert resumed.is_set()
        return calls.seen

    seen = asyncio.run(push())
    assert seen == [("pause", False), ("begin", False), ("broadcast v3", False), ("end", False), ("resume", False)]


def test_weights_the_train_step_wrote_are_loaded_without_an_export_call_and_the_cleanup_cannot_take_them(tmp_path):
    weights = tmp_path / "weights"

    class SlowCleanup(WeightSync):
        def _drop_older(self, path: Path) -> None:
            time.sleep(0.3)  # still deleting while the next step trains, unless export_path waits for it
            super()._drop_older(path)

    async def run() -> tuple[list, WeightSync, str, list[str]]:
        resumed = asyncio.Event()
        resumed.set()
        calls = Calls(resumed)
        sync = SlowCleanup("disk", calls, calls, resumed, weights)  # type: ignore[arg-type]
        await sync.push(1)  # a call of its own, as at the start of a resumed run; its cleanup runs in a thread
        path = await sync.export_path(2)
        Path(path).mkdir(parents=True)  # the step's last train call writes it
        await sync.push(2, exported=True)
        await sync.close()
        return calls.seen, sync, path, sorted(p.name for p in weights.iterdir())

    seen, sync, path, left = asyncio.run(run())
    assert seen == [("export", True), ("load v1 aborting", False), ("load v2 aborting", False)], seen
    assert path == str(weights / "v000002") and sync.current == (path, 2)
    assert left == ["v000002"], "the step's export outlives the deletion of the older ones"


def test_a_distributed_sync_has_no_export_path(tmp_path):
    sync = WeightSync("distributed", None, None, asyncio.Event(), tmp_path)  # type: ignore[arg-type]
    assert asyncio.run(sync.export_path(1)) == ""
