"""One more tensor-parallel rank of the CPU server (``--tp-size N`` starts N - 1 of these; the server is rank 0).

SGLang runs a process per tensor-parallel rank, and each joins the weight-update group as
``rank_offset + tp_rank`` and receives every tensor of every call. This process does the same for the
CPU server, so the group's rank arithmetic and its world size are exercised on a CPU: it joins, receives
each call's tensors into buffers of its own, and answers each tensor's digest, which the server compares
with what its own rank 0 received. Generation stays on rank 0.

The server drives it over stdin/stdout, one JSON object per line (no pickle): ``init``, ``receive``,
``destroy``; each is answered ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``. It logs to stderr
(the server's log) and exits when stdin closes, so it never outlives its server.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from typing import IO, Any

import torch

from hpcrl.logs import setup_logging

log = logging.getLogger("hpcrl.inference.server.tp_rank")


def digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's bytes: two ranks that received the same tensor give the same one."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()


class TpRank:
    """The weight-update groups of one extra rank, by name."""

    def __init__(self, tp_rank: int):
        self.tp_rank = tp_rank
        self.groups: dict[str, Any] = {}

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "init":
            return self.init(msg)
        if op == "receive":
            return self.receive(msg)
        if op == "destroy":
            return self.destroy(msg)
        return {"ok": False, "error": f"unknown op {op!r}"}

    def init(self, msg: dict[str, Any]) -> dict[str, Any]:
        from hpcrl.inference.weight_group import open_weight_group

        args = (msg["master_address"], msg["master_port"], msg["rank"], msg["world_size"], msg["group_name"])
        self.groups[msg["group_name"]] = open_weight_group(*args, msg["backend"], msg["timeout_s"])
        return {"ok": True}

    def receive(self, msg: dict[str, Any]) -> dict[str, Any]:
        from hpcrl.inference.weight_group import dtype_of, receive_tensors

        specs = [(name, dtype_of(dtype), shape) for name, dtype, shape in msg["specs"]]
        tensors = receive_tensors(self.groups[msg["group_name"]], specs)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"ok": True, "digests": [digest(t) for t in tensors.values()], "bytes": nbytes}

    def destroy(self, msg: dict[str, Any]) -> dict[str, Any]:
        from hpcrl.inference.weight_group import close_weight_group

        close_weight_group(self.groups.pop(msg["group_name"]))
        return {"ok": True}


def serve(rank: TpRank, commands: IO[str], replies: IO[str]) -> None:
    for line in commands:
        try:
            answer = rank.handle(json.loads(line))
        except Exception as e:  # a failed join or receive is an answer, not a dead rank
            log.exception("tp rank %d: %s failed", rank.tp_rank, line[:200].strip())
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hpcrl.inference.server.tp_rank", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tp-rank", type=int, required=True)
    args = parser.parse_args(argv)
    replies = os.fdopen(os.dup(1), "w")  # stdout is the reply channel: nothing else may write to it
    os.dup2(2, 1)
    setup_logging("server-tp", args.tp_rank)
    log.info("tensor-parallel rank %d of the CPU server: waiting for commands", args.tp_rank)
    serve(TpRank(args.tp_rank), sys.stdin, replies)
    log.info("tp rank %d: the server closed the channel; exiting", args.tp_rank)


if __name__ == "__main__":
    main()
