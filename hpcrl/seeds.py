"""Seeds derived from ``run.seed`` for each part of a run, the same in every process and run."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int | None, *parts: object) -> int | None:
    """A seed in [0, 2**63) for a part of what ``seed`` seeds (a sample, a turn, a request), the same in every
    process and run (not Python's salted ``hash``); None stays None (no seed: the server's own randomness)."""
    if seed is None:
        return None
    digest = hashlib.blake2b("/".join(map(str, (seed, *parts))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
