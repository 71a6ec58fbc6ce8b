"""One daemon thread that runs submitted calls one at a time, in the order they were submitted.

Not a ThreadPoolExecutor: its threads are joined at interpreter exit, so a handler stuck in a collective
would keep a finished worker process alive; this thread is a daemon and never blocks exit.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any


class HandlerThread:
    def __init__(self, name: str, init: Callable[[], None] | None = None):
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable, tuple] | None] = queue.SimpleQueue()
        self._init = init
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Finish the calls already submitted, then end the thread (does not wait for it)."""
        self._queue.put(None)

    def _main(self) -> None:
        init_error: BaseException | None = None
        if self._init is not None:
            try:
                self._init()
            except BaseException as e:  # reported to every call rather than killing the thread silently
                init_error = e
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            if init_error is not None:
                error = RuntimeError(f"the handler thread's init failed: {init_error!r}")
                error.__cause__ = init_error
                future.set_exception(error)
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)
