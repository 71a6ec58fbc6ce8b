"""Throughput of hpcrl's CPU inference server against in-process batched ``generate``.

    python bench/inference.py [--runs 5] [--requests 64] [--new-tokens 32] [--hidden 64 --layers 2] [--group 8]
    python bench/inference.py --requests 512 --new-tokens 2 --hidden 128   # a default job step's generation

Four ways to produce the same new tokens from the same prompts, measured side by side in one run (the
machine is shared and noisy, so only the ratios mean something):

- in-process: one batched ``model.generate`` call (left-padded, sampling, no early stop);
- server, concurrent: one ``/generate`` request per prompt, all in flight at once through ``InferenceClient``;
- server, groups: the prompts in batched requests of ``--group`` (``generate_many``), all in flight at once:
  how a rollout sends a GRPO group;
- server, one at a time: one request per prompt, each sent after the previous answer.

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


def prompts(tok, count: int) -> list[list[int]]:
    return [tok(f"{i % 10}+{(i * 7) % 10}=")["input_ids"] for i in range(count)]


def in_process(model, tok, batch: list[list[int]], new_tokens: int) -> float:
    width = max(map(len, batch))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in batch])[:, None]).long()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, top_k=0
        )
    return len(batch) * new_tokens / (time.perf_counter() - start)


async def through_server(address: str, batch: list[list[int]], new_tokens: int, way: str, group: int = 8) -> float:
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
    async with InferenceClient([address], request_timeout_s=600) as client:
        start = time.perf_counter()
        if way == "concurrent":
            results = await asyncio.gather(*(client.generate(p, params) for p in batch))
        elif way == "groups":
            chunks = [batch[i : i + group] for i in range(0, len(batch), group)]
            answers = await asyncio.gather(*(client.generate_many(c, params) for c in chunks))
            results = [r for answer in answers for r in answer]
        else:
            results = [await client.generate(p, params) for p in batch]
        elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == new_tokens for r in results)
    return len(batch) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-wait-ms", type=float, default=2.0, help="the server's --batch-wait-ms")
    parser.add_argument("--group", type=int, default=8, help="prompts per batched request in the groups way")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-"))
    model_dir = make_tiny_model(
        work / "model", hidden_size=args.hidden, num_layers=args.layers, intermediate_size=4 * args.hidden
    )
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    batch = prompts(tok, args.requests)
    port = PortAllocator().allocate(1)[0]
    cmd = [sys.executable, "-m", "hpcrl.inference.server", "--model-path", str(model_dir), "--port", str(port)]
    cmd += ["--batch-wait-ms", str(args.batch_wait_ms)]
    with spawn("server", cmd, work / "server.log") as server:
        address = format_hostport("127.0.0.1", port)
        asyncio.run(_wait(address, server))
        ways = {"concurrent": CONCURRENT, "groups": f"server, groups of {args.group}", "one": ONE_AT_A_TIME}
        rows: dict[str, list[float]] = {IN_PROCESS: [], **{name: [] for name in ways.values()}}
        in_process(model, tok, batch[:4], 4)  # warm-up
        for _ in range(args.runs):
            rows[IN_PROCESS].append(in_process(model, tok, batch, args.new_tokens))
            for way, name in ways.items():
                rows[name].append(asyncio.run(through_server(address, batch, args.new_tokens, way, args.group)))
    report(rows, args)


async def _wait(address: str, server) -> None:
    async with InferenceClient([address]) as client:
        await client.wait_healthy(300, check_alive=server.check_alive, poll_s=0.5)


def report(rows: dict[str, list[float]], args) -> None:
    """Medians of throughput, and medians of the ratios taken within each run (the runs side by side)."""
    med = {name: statistics.median(values) for name, values in rows.items()}
    conc, inproc, seq = rows[CONCURRENT], rows[IN_PROCESS], rows[ONE_AT_A_TIME]
    groups = rows[f"server, groups of {args.group}"]
    vs_inproc = statistics.median(c / i for c, i in zip(conc, inproc, strict=True))
    vs_seq = statistics.median(c / s for c, s in zip(conc, seq, strict=True))
    groups_time = statistics.median(i / g for g, i in zip(groups, inproc, strict=True))
    print(
        f"model hidden={args.hidden} layers={args.layers}; {args.requests} prompts x {args.new_tokens} new tokens;"
        f" median of {args.runs} runs, torch threads {torch.get_num_threads()}"
    )
    print(f"| {'way':<24} | {'new tokens/s':>12} | {'runs':<36} |")
    print(f"|{'-' * 26}|{'-' * 14}|{'-' * 38}|")
    for name, values in rows.items():
        print(f"| {name:<24} | {med[name]:>12.0f} | {', '.join(f'{v:.0f}' for v in values):<36} |")
    print(f"concurrent / in-process = {vs_inproc:.2f} (median of per-run ratios; goal >= 0.7)")
    print(f"concurrent / one at a time = {vs_seq:.2f} (median of per-run ratios; goal >= 4)")
    print(f"groups of {args.group}: time / in-process time = {groups_time:.2f} (median of per-run ratios; goal <= 2)")


if __name__ == "__main__":
    main()
