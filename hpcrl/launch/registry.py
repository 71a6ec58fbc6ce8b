"""The worker registry: each worker announces ``host:port`` in a file under the run directory.

On a cluster the run directory is on a shared filesystem, so this needs no service of its own.
Each entry is one JSON file, ``<role>-<rank>.json``, written atomically: a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.net import format_hostport
from hpcrl.rundir import write_atomic


@dataclass(frozen=True)
class Entry:
    role: str
    rank: int
    host: str  # the advertised address (not the bind address)
    port: int
    pid: int = field(default_factory=os.getpid)
    node: str = field(default_factory=socket.gethostname)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return format_hostport(self.host, self.port)


class Registry:
    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def register(self, entry: Entry) -> Path:
        path = self.directory / f"{entry.role}-{entry.rank}.json"
        write_atomic(path, json.dumps(asdict(entry)))
        return path

    def entries(self, role: str) -> list[Entry]:
        found = [Entry(**json.loads(p.read_text())) for p in self.directory.glob(f"{role}-*.json")]
        return sorted((e for e in found if e.role == role), key=lambda e: e.rank)  # not those of "<role>-x"

    def unregister(self, role: str, rank: int) -> None:
        """Forget one worker's entry (it died; the one that replaces it registers anew)."""
        (self.directory / f"{role}-{rank}.json").unlink(missing_ok=True)

    def unregister_own(self, entry: Entry) -> None:
        """Forget ``entry`` as the worker that registered it leaves, unless another process has registered the same
        role and rank since (a replacement started while this worker was cut off, or still ending)."""
        path = self.directory / f"{entry.role}-{entry.rank}.json"
        try:
            now = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return
        if (now.get("pid"), now.get("node")) == (entry.pid, entry.node):
            path.unlink(missing_ok=True)

    def clear(self, role: str) -> None:
        for p in self.directory.glob(f"{role}-*.json"):
            p.unlink(missing_ok=True)

    def wait(
        self,
        role: str,
        count: int,
        timeout_s: float,
        check_alive: Callable[[], None] = lambda: None,
        poll_s: float = 0.2,
    ) -> list[Entry]:
        """Wait until ranks 0..count-1 of ``role`` have registered.

        ``check_alive`` is called on every poll and raises when a worker has died, so a dead worker
        fails the wait at once instead of at the deadline.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            check_alive()
            entries = self.entries(role)
            missing = sorted(set(range(count)) - {e.rank for e in entries})
            if not missing:
                return [e for e in entries if e.rank < count]
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{role} ranks {missing} did not register in {self.directory} within {timeout_s:g} s; "
                    f"see their logs, or raise cluster.roles.{role}.setup_timeout_s"
                )
            time.sleep(poll_s)
