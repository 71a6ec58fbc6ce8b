"""bench/rpc.py: RPC and raw TCP side by side, and the latency table."""

from tests.bench.conftest import assert_table


def test_rpc_bench_prints_throughput_and_latency(run_bench):
    out = run_bench("rpc")
    rows = assert_table(out, "payload", "rpc MiB/s", "raw TCP MiB/s", "rpc / raw")
    assert [r[0] for r in rows] == ["1 MiB tensor", "64 MiB tensor"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    latency = assert_table(out, "latency", "p50 us", "p99 us", "client CPU us a call", "server CPU us a call")
    assert all(float(r[1]) <= float(r[2]) for r in latency), out
    assert all(float(r[3]) > 0 for r in latency), out  # the client's CPU: never 0 for a call
    assert "rpc / raw at 1 MiB" in out and "rpc / raw at 64 MiB" in out and "rpc no-op p50" in out
    batches = assert_table(out, "train step batch", "JSON KiB", "raw KiB", "JSON ms", "raw ms", "JSON / raw time")
    assert [r[0] for r in batches] == ["default job (64x8, 4+2 tokens)", "64x8, 256+256 tokens"]
    assert all(float(r[2]) < float(r[1]) for r in batches), out  # raw tensors are smaller than JSON lists
