"""Receive buffers for large frames, reused once nothing decoded from them is alive any more.

A decoded tensor shares memory with the buffer its frame was read into, so a buffer can only be reused
after every such tensor is gone. Fresh memory is not free either: faulting in the pages of a new
64 MiB buffer costs about as much CPU as copying the frame into it, and doubled the server's CPU time
per large request. So each buffer is handed out as a new numpy view of a pooled array, and a weakref
finalizer on that view puts the array back in the pool when the view is collected: the view is kept
alive by every memoryview and tensor made from it, so that happens only when the last one is gone.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

MIN_POOLED = 1 << 20  # smaller frames are cheap to allocate: not pooled
MAX_POOLED_BYTES = 1 << 30  # idle memory the pool may keep, per process


class BufferPool:
    def __init__(self, max_bytes: int = MAX_POOLED_BYTES, min_size: int = MIN_POOLED):
        self.max_bytes, self.min_size = max_bytes, min_size
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A writable, uninitialised buffer of exactly ``nbytes``."""
        if nbytes < self.min_size:
            return np.empty(nbytes, dtype=np.uint8).data
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            array = free.pop() if free else None
            self._free_bytes -= size if array is not None else 0
        if array is None:
            array = np.empty(size, dtype=np.uint8)
        view = array[:nbytes]
        weakref.finalize(view, self._give_back, array)
        return view.data

    def _give_back(self, array: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + array.nbytes <= self.max_bytes:
                self._free.setdefault(array.nbytes, []).append(array)
                self._free_bytes += array.nbytes

    @property
    def free_bytes(self) -> int:
        return self._free_bytes


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 1/8 of its power of two: at most 12.5% unused."""
    step = max(1, (1 << (nbytes.bit_length() - 1)) // 8)
    return -(-nbytes // step) * step


RECEIVE_POOL = BufferPool()
