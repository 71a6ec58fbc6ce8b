"""The connection under the RPC on a real socket pair: every byte in order through the zero-copy paths, reads that
pause when nobody reads, and an end that names how far a read got."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from hpcrl.rpc.connection import SCRATCH_BYTES, Connection, ConnectionEnded, connect


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_many_buffers_of_every_size_arrive_in_order_through_both_read_paths():
    """Buffers larger than the socket's, smaller than a header, and empty; read back as small exact reads and
    as large reads into buffers of their own, so bytes first read ahead into the scratch buffer must be
    handed over in order."""
    parts = [pattern(n, i) for i, n in enumerate([12, 0, 3, 5 << 20, 1, SCRATCH_BYTES + 7, 100, 9 << 20, 2])]
    wanted = b"".join(parts)

    async def go():
        a, b = socket.socketpair()
        left, right = Connection(a), Connection(b)
        got = bytearray()

        async def read_all():
            sizes = [7, 12, 5 << 20, 1, 3, SCRATCH_BYTES, 100, 200, (9 << 20) - 250, 2, 55, 1]
            for i, size in enumerate(sizes):
                size = min(size, len(wanted) - len(got))
                if size <= SCRATCH_BYTES and i % 2:
                    got.extend(await right.read_exactly(size))
                else:
                    buf = memoryview(bytearray(size))
                    await right.read_into(buf)
                    got.extend(buf)
            assert len(got) == len(wanted)

        await asyncio.gather(left.send(parts), read_all())
        left.close()
        right.close()
        return bytes(got)

    assert asyncio.run(go()) == wanted


def test_nobody_reading_pauses_the_socket_and_nothing_is_lost():
    data = pattern(4 << 20, 9)

    async def go():
        a, b = socket.socketpair()
        left, right = Connection(a), Connection(b)
        sending = asyncio.create_task(left.send([data]))
        await asyncio.sleep(0.3)  # the reader side takes its scratch buffer's worth, then stops taking
        assert not sending.done(), "the sender waits: nobody read, so the socket was not drained"
        buf = memoryview(bytearray(len(data)))
        await right.read_into(buf)
        await sending
        left.close()
        right.close()
        return bytes(buf)

    assert asyncio.run(go()) == data


def test_the_end_of_the_connection_mid_read_names_how_far_it_got():
    async def go():
        a, b = socket.socketpair()
        left, right = Connection(a), Connection(b)
        await left.send([b"x" * 10])
        left.close()
        with pytest.raises(ConnectionEnded, match=r"the peer closed the connection \(after 10 of 20 bytes\)"):
            await right.read_into(memoryview(bytearray(20)))
        assert not right.usable
        right.close()

    asyncio.run(go())


def test_closing_here_wakes_a_waiting_read():
    async def go():
        a, b = socket.socketpair()
        left, right = Connection(a), Connection(b)
        reading = asyncio.create_task(right.read_exactly(4))
        await asyncio.sleep(0.05)
        right.close()
        with pytest.raises(ConnectionEnded, match="closed here"):
            await reading
        left.close()

    asyncio.run(go())


def test_connect_reaches_a_listener_by_name_and_address_and_refused_is_an_oserror():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    async def go():
        for host in ("127.0.0.1", "localhost"):
            conn = await connect(host, port)
            peer, _ = listener.accept()
            peer.sendall(b"hi")
            assert await conn.read_exactly(2) == b"hi"
            conn.close()
            peer.close()
        listener.close()
        with pytest.raises(OSError):
            await connect("127.0.0.1", port)

    asyncio.run(go())


def test_send_nowait_from_another_thread_returns_what_the_socket_did_not_take():
    data = pattern(8 << 20, 5)

    async def go():
        a, b = socket.socketpair()
        left, right = Connection(a), Connection(b)
        rest = await asyncio.to_thread(left.send_nowait, [b"head", data])
        assert rest and sum(len(v) for v in rest) < len(data), "a socket buffer takes less than 8 MiB at once"
        buf = memoryview(bytearray(4 + len(data)))
        await asyncio.gather(left.send(rest), right.read_into(buf))
        left.close()
        assert left.send_nowait([b"x"]) == [memoryview(b"x")], "closed: nothing is written, all is returned"
        right.close()
        return bytes(buf)

    assert asyncio.run(go()) == b"head" + data
