"""Rank claims: a worker that joins a running run takes a rank of its role that no other process holds.

A claim is a file, ``<directory>/<role>-<rank>``, naming the process that holds the rank (pid, node, start time).
It is made whole and then hard-linked into place, which fails if the name exists: of two processes claiming one
rank at once (on one node or on two sharing the run directory over NFS, where link is atomic too) exactly one gets
it, and no reader ever sees a claim half written. The holder keeps its claim for good: it execs its worker, which
keeps the pid, and nothing removes the file when that worker ends.

A claim whose process has ended on this node is stale, and may be taken over. Takeovers race as well, so the
taker first creates ``.<role>-<rank>.<token>.taken`` (O_CREAT|O_EXCL), named after the stale claim's own token:
only one process takes over a given claim, and one that read the stale claim before another replaced it cannot
then replace the new, live one. A claim made on another node is never stale here: whether its process runs cannot
be told from this node, so that rank stays taken (a user who knows it is gone removes the file).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcrl.launch.controller_file import process_runs, process_started

MAX_SCAN = 4096  # ranks an automatic claim tries before it gives up: far more than any fleet joins


@dataclass(frozen=True)
class Claim:
    role: str
    rank: int
    pid: int  # the process holding the rank, on host
    host: str  # its node, as socket.gethostname() names it
    started: float  # its start time (psutil create_time): a pid the kernel reused is not the holder
    token: str  # this claim's own name: a takeover of it is marked with it

    @classmethod
    def mine(cls, role: str, rank: int) -> Claim:
        """A claim on ``role`` ``rank`` by this process, on this node."""
        pid = os.getpid()
        started = process_started(pid)
        assert started is not None, "this process runs"
        return cls(role, rank, pid, socket.gethostname(), started, secrets.token_hex(8))

    def stale(self) -> bool:
        """Its process has ended on this node. A claim from another node is never stale: that cannot be told here."""
        return self.host == socket.gethostname() and not process_runs(self.pid, self.started)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def claim_path(directory: Path, role: str, rank: int) -> Path:
    return Path(directory) / f"{role}-{rank}"


def read_claim(path: Path) -> Claim | None:
    """The claim at ``path``; None when there is none. ``ValueError`` naming the file when it is not a claim."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return Claim(**json.loads(text))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a rank claim ({e}); remove it if no worker of that rank runs") from None


def try_claim(directory: Path, role: str, rank: int) -> tuple[bool, Claim]:
    """Claim ``role`` ``rank`` for this process: (True, this process's claim) when it got the rank, else (False,
    the live claim, or the other node's, that holds it)."""
    directory.mkdir(parents=True, exist_ok=True)
    mine = Claim.mine(role, rank)
    path = claim_path(directory, role, rank)
    tmp = directory / f".{path.name}.{mine.token}.tmp"
    tmp.write_text(json.dumps(asdict(mine)) + "\n")
    try:
        return _claim(tmp, path, mine)
    finally:
        tmp.unlink(missing_ok=True)


def _claim(tmp: Path, path: Path, mine: Claim) -> tuple[bool, Claim]:
    held = None
    while held is None:  # a claim removed between a failed link and its reading: link again
        try:
            os.link(tmp, path)
            return True, mine
        except FileExistsError:
            held = read_claim(path)
    if not held.stale():
        return False, held
    try:
        os.close(os.open(path.with_name(f".{path.name}.{held.token}.taken"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another process is taking this stale claim over: the rank is theirs
        return False, read_claim(path) or held
    os.replace(tmp, path)
    return True, mine


def claim_first_free(directory: Path, role: str, first: int) -> Claim:
    """Claim the lowest rank >= ``first`` of ``role`` that no live claim holds."""
    for rank in range(first, first + MAX_SCAN):
        won, claim = try_claim(directory, role, rank)
        if won:
            return claim
    raise RuntimeError(
        f"{role} ranks {first}..{first + MAX_SCAN - 1} are all claimed in {directory}; remove the claims of "
        "workers that are gone"
    )
