"""Pooled receive buffers: reused only once every tensor decoded from them is gone."""

from __future__ import annotations

import gc

import torch

from hpcrl.rpc import decode, encode
from hpcrl.rpc.buffers import BufferPool, size_class
from hpcrl.rpc.messages import Echo


def receive(pool: BufferPool, frame: bytes) -> memoryview:
    buf = pool.take(len(frame))
    buf[:] = frame
    return buf


def test_a_buffer_is_reused_only_after_its_tensors_are_gone():
    pool = BufferPool(min_size=1024)
    frame = encode(Echo([torch.arange(1000, dtype=torch.float32)], ""))
    first = decode(receive(pool, frame))
    assert pool.free_bytes == 0, "the tensor still uses the buffer"
    second = decode(receive(pool, frame))  # a different buffer
    assert first.tensors[0].data_ptr() != second.tensors[0].data_ptr()
    second.tensors[0].fill_(-1.0)
    assert first.tensors[0][:3].tolist() == [0.0, 1.0, 2.0]
    ptr = first.tensors[0].data_ptr()
    del first
    gc.collect()
    assert pool.free_bytes == size_class(len(frame))
    third = decode(receive(pool, frame))
    assert third.tensors[0].data_ptr() == ptr, "the freed buffer is taken again"
    assert third.tensors[0][:3].tolist() == [0.0, 1.0, 2.0]


def test_small_frames_and_the_pool_cap():
    pool = BufferPool(max_bytes=4096, min_size=1024)
    assert len(pool.take(100)) == 100
    big = pool.take(10_000)
    del big
    gc.collect()
    assert pool.free_bytes == 0, "a buffer over max_bytes is freed, not kept"


def test_size_classes_waste_at_most_an_eighth():
    for n in [1, 7, 8, 9, 1000, 1 << 20, (1 << 20) + 1, 64 << 20, 3 * (1 << 25) + 5]:
        c = size_class(n)
        assert n <= c <= n * 1.125 + 1
