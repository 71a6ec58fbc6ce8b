"""hpcrl's RPC against raw loopback TCP: throughput of tensor payloads, and no-op call latency.

    python bench/rpc.py [--runs 5] [--sizes-mib 1 64] [--quick]

A second process (this script with ``--serve``) hosts an ``RpcServer`` and a raw TCP sink on 127.0.0.1, as a
trainer rank is a process of its own. The client (this process) sends, side by side in each run:

- RPC: ``RpcClient.call("sink", [Echo([tensor], "")])``: one uint8 tensor of the payload size, encoded as a
  frame (header + the tensor's bytes), decoded by the server into a tensor, answered with an ``Ack``;
- raw TCP: the same bytes with ``socket.sendall`` after an 8-byte length, received by the sink with
  ``recv_into`` into one preallocated buffer, answered with one byte.

Throughput is payload bytes over the wall time of ``--calls`` sends one after another (connections already
open). Latency: ``ping`` (a Ping answered with a Pong, handler thread included) and a 1-byte raw round trip,
one at a time, with the CPU time each side spent per call over the same calls (this process's, and the server
process's from psutil): on a shared machine the wall times carry the other load, the CPU times much less.
Goals: RPC / raw >= 0.5 at 1 MiB and at 64 MiB, no-op p50 <= 250 us. Medians over runs of the per-run ratios.

A train step's batch, side by side in each run: one rank's batch of the default job (64 prompts x 8 samples
of 4 prompt + 2 completion tokens, with behaviour logprobs and versions) and a larger one of the same count
(256 + 256 tokens a sample), sent ``--batch-calls`` times each way, one call after another:

- raw: ``TrainStep(SequenceBatch.pack(sequences))``, flat tensors whose bytes travel outside the JSON header,
  as the controller sends it; the server ``unpack``s it into per-sequence lists, as a trainer rank does;
- JSON: the same sequences as JSON lists of numbers in the header (``JsonTrainStep``, registered here: the
  format the train step had before), which the server's decoder turns into the same lists.

Each time is a whole call: build and encode on the client, send, decode and unpack on the server, an Ack back.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import psutil
import torch
from _jobs import median, table

from hpcrl.rpc import RpcClient, RpcServer, encode
from hpcrl.rpc.messages import Ack, Echo, Ping, Pong, SequenceBatch, SequenceData, TrainStep, register

TOKEN = "bench-token-" + "x" * 32
MIB = 1 << 20
BATCHES = {"default job (64x8, 4+2 tokens)": (512, 4, 2), "64x8, 256+256 tokens": (512, 256, 256)}


@register
@dataclasses.dataclass
class JsonSequence:  # SequenceData's fields, as the train step carried them before: JSON lists
    input_ids: list[int]
    loss_mask: list[int]
    advantage: float
    old_logprobs: list[float] | None
    prox_logprobs: list[float] | None
    ref_logprobs: list[float] | None
    versions: list[int] | None
    token_advantages: list[float] | None = None
    returns: list[float] | None = None
    old_values: list[float] | None = None


@register
@dataclasses.dataclass
class JsonTrainStep:
    sequences: list[JsonSequence]
    temperature: float


def train_batch(samples: int, prompt: int, completion: int) -> list[SequenceData]:
    """Sequences shaped as ``to_sequences`` makes them: float32 logprobs (as servers send), -1 versions on prompts."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(samples):
        ids = torch.randint(3, 2000, (prompt + completion,), generator=gen).tolist()
        logprobs = (-torch.rand(completion, generator=gen) * 5).tolist()
        out.append(
            SequenceData(
                input_ids=ids,
                loss_mask=[0] * prompt + [1] * completion,
                advantage=float(torch.randn(1, generator=gen)),
                old_logprobs=[0.0] * prompt + logprobs,
                prox_logprobs=None,
                ref_logprobs=None,
                versions=[-1] * prompt + [i % 3] * completion,
            )
        )
    return out


# --- the server process ---------------------------------------------------------------------------------


def serve() -> None:
    def sink(msg: Echo) -> Ack:
        assert msg.tensors[0].numel() > 0
        return Ack()

    def ping(_: Ping) -> Pong:
        return Pong(rank=0, pid=os.getpid())

    def train_raw(msg: TrainStep) -> Ack:
        assert len(msg.batch.unpack()) > 0
        return Ack()

    def train_json(msg: JsonTrainStep) -> Ack:
        assert len(msg.sequences) > 0  # the decoder already made the lists
        return Ack()

    handlers = {"sink": sink, "ping": ping, "train_raw": train_raw, "train_json": train_json}
    server = RpcServer(handlers, TOKEN, 0, host="127.0.0.1")
    address = server.start_in_thread()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_sink, args=(listener,), daemon=True).start()
    print(json.dumps({"rpc": address, "raw": listener.getsockname()[1], "pid": os.getpid()}), flush=True)
    server.serve_until_stopped()


def _raw_sink(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(0))
    while True:
        header = _recv_exactly(conn, memoryview(bytearray(8)))
        if header is None:
            return
        (size,) = struct.unpack("!Q", header)
        if len(buf) < size:
            buf = memoryview(bytearray(size))
        _recv_exactly(conn, buf[:size])
        conn.sendall(b"k")


def _recv_exactly(conn: socket.socket, view: memoryview) -> memoryview | None:
    pos = 0
    while pos < len(view):
        n = conn.recv_into(view[pos:])
        if n == 0:
            return None
        pos += n
    return view


# --- the client -----------------------------------------------------------------------------------------


class Raw:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, payload: memoryview) -> None:
        self.sock.sendall(struct.pack("!Q", len(payload)))
        self.sock.sendall(payload)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("the raw sink went away")


async def rpc_throughput(client: RpcClient, tensor: torch.Tensor, calls: int) -> float:
    msg = Echo([tensor], "")
    start = time.perf_counter()
    for _ in range(calls):
        await client.call("sink", [msg])
    return tensor.numel() * calls / (time.perf_counter() - start) / MIB


def raw_throughput(raw: Raw, tensor: torch.Tensor, calls: int) -> float:
    payload = memoryview(tensor.numpy()).cast("B")
    start = time.perf_counter()
    for _ in range(calls):
        raw.send(payload)
    return tensor.numel() * calls / (time.perf_counter() - start) / MIB


async def rpc_latencies(client: RpcClient, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        await client.call("ping", [Ping()])
        out.append(time.perf_counter() - start)
    return out


def raw_latencies(raw: Raw, calls: int) -> list[float]:
    one = memoryview(b"p")
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        raw.send(one)
        out.append(time.perf_counter() - start)
    return out


async def train_batch_ms(client: RpcClient, sequences: list[SequenceData], raw: bool, calls: int) -> float:
    """Median ms of one train-step call carrying ``sequences`` raw (packed tensors) or as JSON lists."""
    as_json = [JsonSequence(**vars(s)) for s in sequences]  # what the old path held already: not timed
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        if raw:
            await client.call("train_raw", [TrainStep(SequenceBatch.pack(sequences), 1.0)])
        else:
            await client.call("train_json", [JsonTrainStep(as_json, 1.0)])
        out.append(time.perf_counter() - start)
    return median(out) * 1e3


class CpuMeter:
    """CPU seconds (user + system) of this process and of the server's, read before and after some calls."""

    def __init__(self, server_pid: int):
        self.server = psutil.Process(server_pid)

    def read(self) -> tuple[float, float]:
        times = self.server.cpu_times()
        return time.process_time(), times.user + times.system


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def calls_for(size: int, quick: bool) -> int:
    """About 1 GiB a measurement (at least 5 calls); a tenth of that with --quick."""
    budget = (64 if quick else 1024) * MIB
    return max(5 if not quick else 2, budget // size)


async def measure(addresses: dict, args) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {}
    tensors = {mib: torch.randint(0, 256, (int(mib * MIB),), dtype=torch.uint8) for mib in args.sizes_mib}
    batches = {name: train_batch(*shape) for name, shape in BATCHES.items()}
    raw, cpu = Raw(addresses["raw"]), CpuMeter(addresses["pid"])
    async with RpcClient([addresses["rpc"]], TOKEN) as client:
        for sequences in batches.values():  # warm-up
            await train_batch_ms(client, sequences, True, 2)
            await train_batch_ms(client, sequences, False, 2)
        for t in tensors.values():  # warm-up: connections, buffer pools
            await client.call("sink", [Echo([t], "")])
            raw.send(memoryview(t.numpy()).cast("B"))
        await rpc_latencies(client, 20)
        for _ in range(args.runs):
            for mib, t in tensors.items():
                calls = calls_for(t.numel(), args.quick)
                rows.setdefault(f"rpc {mib:g} MiB", []).append(await rpc_throughput(client, t, calls))
                rows.setdefault(f"raw {mib:g} MiB", []).append(raw_throughput(raw, t, calls))
            before = cpu.read()
            rpc_lat = await rpc_latencies(client, args.pings)
            between = cpu.read()
            raw_lat = raw_latencies(raw, args.pings)
            after = cpu.read()
            for way, (start, end) in (("rpc", (before, between)), ("raw", (between, after))):
                rows.setdefault(f"{way} cpu client", []).append((end[0] - start[0]) / args.pings * 1e6)
                rows.setdefault(f"{way} cpu server", []).append((end[1] - start[1]) / args.pings * 1e6)
            rows.setdefault("rpc ping p50", []).append(percentile(rpc_lat, 0.5) * 1e6)
            rows.setdefault("rpc ping p99", []).append(percentile(rpc_lat, 0.99) * 1e6)
            rows.setdefault("raw 1 B p50", []).append(percentile(raw_lat, 0.5) * 1e6)
            rows.setdefault("raw 1 B p99", []).append(percentile(raw_lat, 0.99) * 1e6)
            for name, sequences in batches.items():
                for way in ("json", "raw"):
                    ms = await train_batch_ms(client, sequences, way == "raw", args.batch_calls)
                    rows.setdefault(f"{way} {name}", []).append(ms)
        await client.shutdown()
    raw.sock.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 64])
    parser.add_argument("--pings", type=int, default=1000, help="no-op calls per latency measurement")
    parser.add_argument("--batch-calls", type=int, default=10, help="train-step calls per batch, way and run")
    parser.add_argument("--quick", action="store_true", help="one run, small counts (smoke test)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve()
    if args.quick:
        args.runs, args.pings, args.batch_calls = 1, 50, 3
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        addresses = json.loads(server.stdout.readline())
        rows = asyncio.run(measure(addresses, args))
        server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()  # only if it did not stop on the shutdown call
            server.wait()
    report(rows, args)


def report(rows: dict[str, list[float]], args) -> None:
    print(f"loopback 127.0.0.1, server in a second process; median of {args.runs} runs")
    out = []
    for mib in args.sizes_mib:
        rpc, raw = rows[f"rpc {mib:g} MiB"], rows[f"raw {mib:g} MiB"]
        ratio = median([a / b for a, b in zip(rpc, raw, strict=True)])
        each = ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(rpc, raw, strict=True))
        out.append([f"{mib:g} MiB tensor", median(rpc), median(raw), ratio, each])
    print(table(["payload", "rpc MiB/s", "raw TCP MiB/s", "rpc / raw", "each run (rpc/raw)"], out))
    print()
    lat = [
        ["rpc no-op call (Ping -> Pong)", median(rows["rpc ping p50"]), median(rows["rpc ping p99"])],
        ["raw TCP 1-byte round trip", median(rows["raw 1 B p50"]), median(rows["raw 1 B p99"])],
    ]
    for row, way in zip(lat, ("rpc", "raw"), strict=True):
        row += [median(rows[f"{way} cpu client"]), median(rows[f"{way} cpu server"])]
    print(table(["latency", "p50 us", "p99 us", "client CPU us a call", "server CPU us a call"], lat))
    p50 = median(rows["rpc ping p50"])
    print(f"rpc no-op p50 = {p50:.0f} us (goal <= 250): {'met' if p50 <= 250 else 'missed'}")
    for mib in args.sizes_mib:
        ratio = median([a / b for a, b in zip(rows[f"rpc {mib:g} MiB"], rows[f"raw {mib:g} MiB"], strict=True)])
        print(f"rpc / raw at {mib:g} MiB = {ratio:.2f} (goal >= 0.5): {'met' if ratio >= 0.5 else 'missed'}")
    print()
    out = []
    for name, (samples, prompt, completion) in BATCHES.items():
        sequences = train_batch(samples, prompt, completion)
        json_kib = len(encode(JsonTrainStep([JsonSequence(**vars(s)) for s in sequences], 1.0))) / 1024
        raw_kib = len(encode(TrainStep(SequenceBatch.pack(sequences), 1.0))) / 1024
        js, rw = rows[f"json {name}"], rows[f"raw {name}"]
        ratio = median([a / b for a, b in zip(js, rw, strict=True)])
        each = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(js, rw, strict=True))
        out.append([name, json_kib, raw_kib, median(js), median(rw), ratio, each])
    header = ["train step batch", "JSON KiB", "raw KiB", "JSON ms", "raw ms", "JSON / raw time", "each run (JSON/raw)"]
    print(table(header, out))


if __name__ == "__main__":
    main()
