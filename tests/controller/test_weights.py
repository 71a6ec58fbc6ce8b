"""The order of a disk weight push: the export runs while generation goes on; the pause covers the load only."""

import asyncio

from hpcrl.controller.weights import WeightSync


class Calls:
    """A client and trainers that record each call and whether generation was open (``resumed`` set) then."""

    def __init__(self, resumed: asyncio.Event):
        self.resumed = resumed
        self.seen: list[tuple[str, bool]] = []

    def _note(self, name: str) -> None:
        self.seen.append((name, self.resumed.is_set()))

    async def export(self, path) -> None:
        self._note("export")
        path.mkdir(parents=True)

    async def pause(self, mode: str) -> None:
        assert mode == "abort"
        self._note("pause")

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        self._note(f"load v{version}")

    async def resume(self) -> None:
        self._note("resume")


def test_a_disk_push_exports_before_the_pause_and_pauses_only_for_the_load(tmp_path):
    async def push_twice() -> tuple[list, WeightSync]:
        resumed = asyncio.Event()
        resumed.set()
        calls = Calls(resumed)
        sync = WeightSync("disk", calls, calls, resumed, tmp_path / "weights")  # type: ignore[arg-type]
        await sync.push(1)
        await sync.push(2)
        assert resumed.is_set(), "generation is open again after the push"
        return calls.seen, sync

    seen, sync = asyncio.run(push_twice())
    one_push = [("export", True), ("pause", False), ("load v{}", False), ("resume", False)]
    assert seen == [(name.format(v), open_) for v in (1, 2) for name, open_ in one_push]
    assert sync.current == (str(tmp_path / "weights" / "v000002"), 2)
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v000002"], "the older export is deleted"
