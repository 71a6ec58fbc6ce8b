"""The CPU server's tensor-parallel ranks 1..N-1 (``--tp-size N``), as child processes (``tp_rank.py``).

The server (rank 0) sends each the same command and reads one answer from each; a command that joins or
receives blocks in the child until the trainer arrives, so the server sends first (``send``), does its
own part, then collects (``collect``, in a thread). A child that exits while the server runs takes the
server down with it, as a dead SGLang TP worker does: a half-present server would hang the next push.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)
_WATCH_S = 0.5


class TpRanks:
    def __init__(self, tp_size: int):
        if tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self._closing = False
        self.children = [self._spawn(k) for k in range(1, tp_size)]
        self._lock = threading.Lock()  # one command at a time on the channels
        if self.children:
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    @staticmethod
    def _spawn(tp_rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "hpcrl.inference.server.tp_rank", "--tp-rank", str(tp_rank)]
        # stderr is inherited: the child's log lines go to the server's log
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        log.info("started tensor-parallel rank %d (pid %d)", tp_rank, child.pid)
        return child

    def send(self, messages: list[dict[str, Any]]) -> None:
        """Give child k (tp rank k + 1) ``messages[k]``; the answers come from ``collect``."""
        self._lock.acquire()
        try:
            for child, message in zip(self.children, messages, strict=True):
                assert child.stdin is not None
                child.stdin.write(json.dumps(message) + "\n")
                child.stdin.flush()
        except BaseException:
            self._lock.release()
            raise

    def collect(self) -> list[dict[str, Any]]:
        """Each child's answer to what ``send`` gave it (blocking), in tp-rank order."""
        try:
            answers = []
            for k, child in enumerate(self.children, start=1):
                assert child.stdout is not None
                line = child.stdout.readline()
                answers.append(json.loads(line) if line else {"ok": False, "error": f"tp rank {k} exited"})
            return answers
        finally:
            self._lock.release()

    def close(self) -> None:
        self._closing = True
        for child in self.children:
            if child.stdin:
                child.stdin.close()  # the child exits at the end of its input
        for child in self.children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()

    def _watch(self) -> None:
        while not self._closing:
            for k, child in enumerate(self.children, start=1):
                code = child.poll()
                if code is not None and not self._closing:
                    log.error("tensor-parallel rank %d (pid %d) exited with %s: the server stops", k, child.pid, code)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(_WATCH_S)
