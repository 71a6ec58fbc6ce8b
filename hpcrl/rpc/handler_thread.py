"""One daemon thread that runs submitted calls one at a time, in the order they were submitted.

Not a ThreadPoolExecutor: its threads are joined at interpreter exit, so a handler stuck in a collective
would keep a finished worker process alive; this thread is a daemon and never blocks exit.

A call's result is handed back lazily: the event loop is woken (one ``call_soon_threadsafe``) only when
someone on it already waits for the result (``Call.result``); when the loop asks after the call is done, it
reads the result without any wake-up. Waking a sleeping event loop from another thread costs a socket
write, an epoll wake-up and two turns of the loop; the server's plain handlers send their own reply, so the
loop only needs their result when the connection's next request arrives, by which time it is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any


class HandlerThread:
    def __init__(self, name: str, init: Callable[[], None] | None = None):
        self._queue: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._init = init
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Call:
        """Queue ``fn(*args)`` from the event loop; ``await call.result()`` there gives its result or raises."""
        call = Call(asyncio.get_running_loop(), fn, args)
        self._queue.put(call)
        return call

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
        while (call := self._queue.get()) is not None:
            call.run(init_error)


class Call:
    """One submitted call. ``result`` and ``cancel`` on the event loop; ``run`` on the handler thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: tuple):
        self.loop, self.fn, self.args = loop, fn, args
        self._lock = threading.Lock()  # orders "done" on the thread against "a waiter exists" on the loop
        self._done = self._cancelled = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """A call the thread has not started yet will not run (``result`` then raises CancelledError)."""
        self._cancelled = True

    async def result(self) -> Any:
        """The call's return value, or what it raised; waits (woken by the thread) only if it is not done."""
        with self._lock:
            if not self._done:
                self._waiter = self.loop.create_future()
        if self._waiter is not None:
            await self._waiter
        if self._error is not None:
            raise self._error
        return self._value

    def run(self, init_error: BaseException | None) -> None:
        """On the handler thread."""
        value, error = None, None
        if self._cancelled:  # a racy read is harmless: at worst a call cancelled just now still runs
            error = asyncio.CancelledError()
        elif init_error is not None:
            error = RuntimeError(f"the handler thread's init failed: {init_error!r}")
            error.__cause__ = init_error
        else:
            try:
                value = self.fn(*self.args)
            except BaseException as e:
                error = e
        self.fn, self.args = _nothing, ()  # the request (and its receive buffer) is freed now, not at the next call
        with self._lock:
            self._value, self._error, self._done = value, error, True
            waiter = self._waiter
        if waiter is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for this any more
                self.loop.call_soon_threadsafe(_wake, waiter)


def _nothing() -> None:
    pass


def _wake(waiter: asyncio.Future[None]) -> None:
    """On the event loop."""
    if not waiter.done():
        waiter.set_result(None)
