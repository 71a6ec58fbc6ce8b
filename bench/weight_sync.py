"""Weight sync mechanisms: disk (safetensors) against a gloo broadcast, and the raw copy of the same bytes.

    python bench/weight_sync.py [--runs 3] [--models tiny 100m] [--dir DIR] [--quick]

The mechanisms themselves, between two processes, with the code the job runs on each side (driving the
whole job would add the FSDP gather, HTTP and pausing, the same for both ways; the job's own ``time_sync_s``
for the tiny model is in ``bench/async_pipeline.py``'s metrics). This process plays trainer rank 0 with the
full model in memory; a second process (this script with ``--receive``) plays the CPU inference server, with
the server's ``ModelRunner``. Per model, side by side in each run:

- disk: write the weights as ``Engine.export_weights`` does for the job's weight sync (one safetensors file
  by ``safetensors.torch.save_file``, tied copies dropped, into a hidden directory renamed into place), then
  the receiver's ``ModelRunner.load_weights_from_disk`` (safetensors ``load_file`` + copy into the
  parameters); "disk: export" is the writing part alone;
- disk, save_pretrained: the same, written as ``Engine.export_hf`` does (``save_pretrained``, the weight
  sync's way before 2026-12-02; without the tokenizer files ``export_hf`` also copies);
- gloo: the weight-update group of ``hpcrl/inference/weight_group.py`` (rank 0 + the receiver), rank 0
  ``send_tensors``, the receiver ``receive_tensors`` + ``ModelRunner.load_tensors``, as the server's
  ``/update_weights_from_distributed`` does;
- memcpy: ``copy_`` of every tensor into a preallocated one (the bytes once through memory);
- raw disk: the same bytes written to one file and read back into preallocated buffers (no fsync, as
  ``save_pretrained`` does none; the read comes from the page cache, as the safetensors load does).

Each time runs from the start on the sender to the receiver's acknowledgement (a 1-element broadcast back).
GB/s is model bytes over that time. A run times each way several times for small models (the median of up
to 10, about 50 MB moved) and once for large ones; medians over runs; ratios within a run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _jobs import median, table
from safetensors.torch import save_file

from hpcrl.inference.weight_group import close_weight_group, open_weight_group, receive_tensors, send_tensors
from hpcrl.models.tiny import make_tiny_model
from hpcrl.net import PortAllocator

MODELS = {  # name -> make_tiny_model sizes
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512),  # the default job's
    "100m": dict(hidden_size=768, num_layers=11, num_heads=12, intermediate_size=3072),
    "quick": dict(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=1024),
}
DISK, GLOO, STOP = 1, 2, 0
WAYS = ("disk", "disk: export", "disk, save_pretrained", "gloo", "memcpy", "raw disk")
ALPHABET = "+0123456789="  # the mod10 task's, as the default job makes its model


def command(group, op: int) -> None:
    dist.broadcast(torch.tensor([op]), src=0, group=group)


def wait_ack(group) -> None:
    dist.broadcast(torch.zeros(1), src=1, group=group)


# --- the receiver (the inference server's side) ---------------------------------------------------------


def receive(model_dir: str, port: int, export_dir: str) -> None:
    from hpcrl.inference.server.runner import ModelRunner

    torch.set_num_threads(1)  # the CPU server's torch thread shares the machine with the sender
    runner = ModelRunner(model_dir)
    group = open_weight_group("127.0.0.1", port, 1, 2)
    specs = [(n, t.dtype, list(t.shape)) for n, t in _state(runner.model).items()]
    while True:
        op = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(op, src=0, group=group)
        if op.item() == STOP:
            break
        if op.item() == DISK:
            runner.load_weights_from_disk(export_dir)
        else:
            runner.load_tensors(receive_tensors(group, specs))
        dist.broadcast(torch.ones(1), src=1, group=group)
    close_weight_group(group)


# --- the sender (trainer rank 0's side) -----------------------------------------------------------------


def _state(model) -> dict[str, torch.Tensor]:
    """The state dict without tied copies (``lm_head.weight``), as ``Engine.export_hf`` writes and pushes it."""
    seen, out = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor
    return out


def export(model, state: dict[str, torch.Tensor], out: Path, save_pretrained: bool = False) -> None:
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if save_pretrained:
        model.save_pretrained(tmp, state_dict=dict(state), safe_serialization=True)  # it empties the dict it gets
    else:
        tmp.mkdir(parents=True)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def raw_disk(tensors: list[torch.Tensor], into: list[torch.Tensor], path: Path) -> None:
    with path.open("wb") as f:
        for t in tensors:
            f.write(memoryview(t.numpy()).cast("B"))
    with path.open("rb") as f:
        for t in into:
            f.readinto(memoryview(t.numpy()).cast("B"))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, sizes: dict, work: Path, runs: int) -> dict[str, list[float]]:
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(work / name, characters=ALPHABET, **sizes)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    state = _state(model)
    tensors = [t.contiguous() for t in state.values()]
    copies = [torch.empty_like(t) for t in tensors]
    export_dir = work / f"{name}-export"
    port = PortAllocator().allocate(1)[0]
    cmd = [sys.executable, __file__, "--receive", str(model_dir), str(port), str(export_dir)]
    receiver = subprocess.Popen(cmd)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    size = sum(t.numel() * t.element_size() for t in tensors)
    repeat = max(1, min(10, int(50e6 // size)))  # small models: the median of several, against the noise
    try:
        group = open_weight_group("127.0.0.1", port, 0, 2)

        def disk(save_pretrained: bool = False) -> float:
            start = time.perf_counter()
            export(model, state, export_dir, save_pretrained)
            if not save_pretrained:
                lap["disk: export"].append(time.perf_counter() - start)
            command(group, DISK)
            wait_ack(group)
            return time.perf_counter() - start

        def gloo() -> None:
            command(group, GLOO)
            send_tensors(group, tensors)
            wait_ack(group)

        def memcpy() -> None:
            for src, dst in zip(tensors, copies, strict=True):
                dst.copy_(src)

        ways = {
            "disk": disk,
            "disk, save_pretrained": lambda: disk(save_pretrained=True),
            "gloo": lambda: _timed(gloo),
            "memcpy": lambda: _timed(memcpy),
            "raw disk": lambda: _timed(lambda: raw_disk(tensors, copies, work / f"{name}.raw")),
        }
        for run in range(runs + 1):  # run 0 warms up (page cache, gloo buffers)
            lap: dict[str, list[float]] = {way: [] for way in times}
            for way, fn in ways.items():
                lap[way] = [fn() for _ in range(repeat)]
            if run:
                for way in times:
                    times[way].append(median(lap[way]))
        command(group, STOP)
        close_weight_group(group)
        receiver.wait(60)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    if receiver.returncode != 0:
        raise RuntimeError(f"the receiver exited with {receiver.returncode}")
    times["params"] = [float(sum(t.numel() for t in tensors))]
    times["bytes"], times["repeat"] = [float(size)], [float(repeat)]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["tiny", "100m"], choices=list(MODELS))
    parser.add_argument("--dir", default=None, help="where exports and files go (default: the temp directory)")
    parser.add_argument("--quick", action="store_true", help="one run, tiny and a 2M-parameter model (smoke)")
    parser.add_argument("--receive", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        return receive(args.receive[0], int(args.receive[1]), args.receive[2])
    if args.quick:
        args.runs, args.models = 1, ["tiny", "quick"]
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-weights-", dir=args.dir))
    try:
        results = {name: measure(name, MODELS[name], work, args.runs) for name in args.models}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, args, work)


def report(results: dict[str, dict[str, list[float]]], args, work: Path) -> None:
    print(f"median of {args.runs} runs; files under {work.parent}; torch threads {torch.get_num_threads()}")
    rows = []
    for name, t in results.items():
        size = t["bytes"][0]
        for way in WAYS:
            rows.append(
                [
                    f"{name} ({t['params'][0] / 1e6:.1f}M params, {size / 1e6:.0f} MB)",
                    way,
                    median(t[way]) * 1e3,
                    size / median(t[way]) / 1e9,
                    median([a / b for a, b in zip(t[way], t["memcpy"], strict=True)]),
                    ", ".join(f"{v * 1e3:.1f}" for v in t[way]),
                ]
            )
    print(table(["model", "way", "ms", "GB/s", "x memcpy time", "ms, each run"], rows))
    for name, t in results.items():
        gloo_vs_disk = median([a / b for a, b in zip(t["gloo"], t["disk"], strict=True)])
        disk_vs_raw = median([a / b for a, b in zip(t["disk"], t["raw disk"], strict=True)])
        pretrained = median([a / b for a, b in zip(t["disk, save_pretrained"], t["disk"], strict=True)])
        print(
            f"{name}: gloo / disk time = {gloo_vs_disk:.2f}; disk (safetensors) / raw disk time = {disk_vs_raw:.2f}; "
            f"disk with save_pretrained / disk = {pretrained:.2f}"
        )


if __name__ == "__main__":
    main()
