"""Throughput of hpcrl's CPU inference server against in-process batched ``generate``.

    python bench/inference.py [--runs 5] [--requests 64] [--new-tokens 32] [--hidden 64 --layers 2] [--group 8]
    python bench/inference.py --requests 512 --new-tokens 2 --hidden 128   # a default job step's generation

The ``--requests`` rows are GRPO groups: ``--requests / --group`` distinct prompts of the mod10 task, each
``--group`` times in a row, as a step's rollout asks for them. Four ways to produce the same new tokens from
them, measured side by side in one run (the machine is shared and noisy, so only the ratios mean something):

- in-process: one batched ``model.generate`` call over all rows (left-padded, sampling, no early stop), the
  faster of two calls, one with 1 torch thread and one with all (on a shared 2-core machine under load, 2
  threads spin against the other processes and can be many times slower: the strictest yardstick is the faster);
- server, concurrent: one ``/generate`` request per row, all in flight at once through ``InferenceClient``;
- server, groups: one batched request per group (``generate_many``), all in flight at once: how a rollout
  sends a GRPO group;
- server, one at a time: one request per row, each sent after the previous answer.

Every server request carries a ``sampling_seed`` of its own, as the rollout's do. One client serves every
run, its connections opened by a warm-up pass, as the job's client lives across steps.

Prints new tokens/s (median of ``--runs``) and the ratios; goals: concurrent >= 0.7x in-process and
>= 4x one at a time; the groups' time at most 2x the in-process call's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpcrl.inference.client import InferenceClient
from hpcrl.launch.process import spawn
from hpcrl.models.tiny import make_tiny_model
from hpcrl.net import PortAllocator, format_hostport

IN_PROCESS, CONCURRENT, ONE_AT_A_TIME = "in-process generate", "server, concurrent", "server, one at a time"
WAYS = ("concurrent", "groups", "one")


def prompts(tok, count: int, group: int) -> list[list[int]]:
    """``count`` rows: distinct prompts (up to 100 of them), each ``group`` times in a row."""
    return [tok(f"{(i // group) % 10}+{(i // group // 10) % 10}=")["input_ids"] for i in range(count)]


def in_process(model, tok, batch: list[list[int]], new_tokens: int) -> float:
    """New tokens/s of the faster of two calls: with 1 torch thread and with all."""
    threads = torch.get_num_threads()
    rates = []
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        rates.append(_generate(model, tok, batch, new_tokens))
    torch.set_num_threads(threads)
    return max(rates)


def _generate(model, tok, batch: list[list[int]], new_tokens: int) -> float:
    width = max(map(len, batch))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in batch])[:, None]).long()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, top_k=0
        )
    return len(batch) * new_tokens / (time.perf_counter() - start)


def seeded(params: dict, rows: int) -> list[dict]:
    """One sampling_seed per row, as the rollout sends them."""
    return [{**params, "sampling_seed": 1000 + row} for row in range(rows)]


async def through_server(client: InferenceClient, batch: list[list[int]], new_tokens: int, way: str, group: int):
    each = seeded({"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}, len(batch))
    start = time.perf_counter()
    if way == "concurrent":
        results = await asyncio.gather(*(client.generate(p, s) for p, s in zip(batch, each, strict=True)))
    elif way == "groups":
        spans = [slice(i, i + group) for i in range(0, len(batch), group)]
        answers = await asyncio.gather(*(client.generate_many(batch[s], each[s]) for s in spans))
        results = [r for answer in answers for r in answer]
    else:
        results = [await client.generate(p, s) for p, s in zip(batch, each, strict=True)]
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == new_tokens for r in results)
    return len(batch) * new_tokens / elapsed


async def measure(address: str, server, model, tok, batch: list[list[int]], args) -> dict[str, list[float]]:
    """Each run: the in-process call, then every way through the server, side by side."""
    names = {"concurrent": CONCURRENT, "groups": f"server, groups of {args.group}", "one": ONE_AT_A_TIME}
    ways = {way: names[way] for way in WAYS if way in args.ways}
    rows: dict[str, list[float]] = {IN_PROCESS: [], **{name: [] for name in ways.values()}}
    async with InferenceClient([address], request_timeout_s=600) as client:
        await client.wait_healthy(300, check_alive=server.check_alive, poll_s=0.5)
        in_process(model, tok, batch[:4], 4)  # warm-up
        for way in ways:  # warm-up, and the client's connections opened
            await through_server(client, batch, 1, way, args.group)
        for _ in range(args.runs):
            rows[IN_PROCESS].append(in_process(model, tok, batch, args.new_tokens))
            for way, name in ways.items():
                rows[name].append(await through_server(client, batch, args.new_tokens, way, args.group))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64, help="rows: prompts x --group")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-wait-ms", type=float, default=2.0, help="the server's --batch-wait-ms")
    parser.add_argument("--torch-threads", type=int, default=0, help="the server's --torch-threads; 0: its default")
    parser.add_argument("--group", type=int, default=8, help="rows per GRPO group: one batched request")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS, help="the server's ways to measure")
    args = parser.parse_args()
    if args.requests % args.group:
        parser.error(f"--requests ({args.requests}) must be a multiple of --group ({args.group})")
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-"))
    model_dir = make_tiny_model(
        work / "model", hidden_size=args.hidden, num_layers=args.layers, intermediate_size=4 * args.hidden
    )
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    batch = prompts(tok, args.requests, args.group)
    port = PortAllocator().allocate(1)[0]
    cmd = [sys.executable, "-m", "hpcrl.inference.server", "--model-path", str(model_dir), "--port", str(port)]
    cmd += ["--batch-wait-ms", str(args.batch_wait_ms)]
    if args.torch_threads:
        cmd += ["--torch-threads", str(args.torch_threads)]
    with spawn("server", cmd, work / "server.log") as server:
        rows = asyncio.run(measure(format_hostport("127.0.0.1", port), server, model, tok, batch, args))
    report(rows, args)


def report(rows: dict[str, list[float]], args) -> None:
    """Medians of throughput, and medians of the ratios taken within each run (the runs side by side)."""
    med = {name: statistics.median(values) for name, values in rows.items()}
    inproc = rows[IN_PROCESS]
    print(
        f"model hidden={args.hidden} layers={args.layers}; {args.requests} rows ({args.requests // args.group} prompts"
        f" x {args.group}) x {args.new_tokens} new tokens; median of {args.runs} runs; in-process: the faster of"
        f" torch threads 1 and {torch.get_num_threads()}"
    )
    print(f"| {'way':<24} | {'new tokens/s':>12} | {'runs':<36} |")
    print(f"|{'-' * 26}|{'-' * 14}|{'-' * 38}|")
    for name, values in rows.items():
        print(f"| {name:<24} | {med[name]:>12.0f} | {', '.join(f'{v:.0f}' for v in values):<36} |")
    if CONCURRENT in rows:
        vs_inproc = statistics.median(c / i for c, i in zip(rows[CONCURRENT], inproc, strict=True))
        print(f"concurrent / in-process = {vs_inproc:.2f} (median of per-run ratios; goal >= 0.7)")
    if CONCURRENT in rows and ONE_AT_A_TIME in rows:
        vs_seq = statistics.median(c / s for c, s in zip(rows[CONCURRENT], rows[ONE_AT_A_TIME], strict=True))
        print(f"concurrent / one at a time = {vs_seq:.2f} (median of per-run ratios; goal >= 4)")
    groups = rows.get(f"server, groups of {args.group}")
    if groups:
        groups_time = statistics.median(i / g for g, i in zip(groups, inproc, strict=True))
        print(
            f"groups of {args.group}: time / in-process time = {groups_time:.2f} (median of per-run ratios; goal <= 2)"
        )


if __name__ == "__main__":
    main()
