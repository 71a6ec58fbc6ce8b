"""One reward process: ``python -m hpcrl.reward.worker INDEX SPEC [SPEC ...]``, started and owned by ``RewardPool``.

It resolves each SPEC by import (no function is ever sent to it), answers one handshake line, then scores
batches until its stdin closes. The wire is JSON lines over the process's original stdin and stdout:

    parent -> worker   [["prompt", "completion", "answer", {"column": value}], ...]   one batch per line
    worker -> parent   {"ready": PID} | {"fatal": "why"}                 once, after resolving every SPEC
                       {"v": [1.0, ...]} | {"e": "raised ValueError: ..."}  one line per item, in order: each
                                                                          function's value (the parent weighs them)

Those two descriptors are moved aside before the reward is imported: fd 0 becomes /dev/null and fd 1
becomes stderr, so a reward that prints (or reads stdin) cannot corrupt the wire. The reward runs in
the main thread, where libraries that time themselves out with SIGALRM (math-verify) work. A watchdog
thread exits the process if its parent dies, so a worker stuck in a hung reward is not left behind.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, BinaryIO

from hpcrl.logs import setup_logging
from hpcrl.reward.registry import RewardFns, RewardSpecError, to_reward

MAX_ERROR_CHARS = 2000  # longer exception texts are cut; the full traceback is the reward's to log
_PARENT_POLL_S = 1.0


def main(argv: list[str] | None = None) -> int:
    index, *specs = argv if argv is not None else sys.argv[1:]
    requests, replies = _take_wire()
    setup_logging("reward", index)
    _watch_parent(os.getppid())
    try:
        fns = RewardFns.resolve(specs if len(specs) > 1 else specs[0])
    except RewardSpecError as e:
        _send(replies, {"fatal": str(e)})
        return 1
    _send(replies, {"ready": os.getpid()})
    for line in requests:
        for prompt, completion, answer, columns in json.loads(line):
            _send(replies, score_one(fns, prompt, completion, answer, columns))
    return 0


def score_one(fns: RewardFns, prompt: str, completion: str, answer: str, columns: Mapping[str, Any]) -> dict[str, Any]:
    """``{"v": [each function's reward]}`` or ``{"e": what went wrong}`` (naming the function of a list) for one
    call; the functions run in order and the first that fails ends it."""
    values = []
    for reward in fns.rewards:
        named = f"{reward.name}: " if fns.listed else ""
        try:
            value = reward(prompt, completion, answer, columns)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit and library BaseExceptions too: the worker lives on
            return {"e": _cut(f"{named}raised {type(e).__name__}: {e}")}
        try:
            values.append(to_reward(value))
        except (TypeError, ValueError) as e:
            return {"e": _cut(f"{named}{e}")}
    return {"v": values}


def _take_wire() -> tuple[BinaryIO, BinaryIO]:
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return requests, replies


def _send(replies: BinaryIO, message: dict[str, Any]) -> None:
    # flushed per item: the parent times each call from the previous reply
    replies.write(json.dumps(message).encode() + b"\n")
    replies.flush()


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
