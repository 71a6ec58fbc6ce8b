"""Full fine-tuning against LoRA at a real model's size: the trainers' peak memory, the step's times and the bytes
one weight sync moves, side by side in one run.

    python bench/lora.py [--variants full lora lora-distributed] [--rank 8] [--steps 2] [--shape qwen2.5-0.5b]
    python bench/lora.py --quick        # the tiny shape, full and lora: checks the script (tests/bench)
    python bench/lora.py -- OVERRIDE ... # hpcrl overrides added to every variant

The job is ``bench/scale_real_model.py``'s (``experiment=gsm8k`` on a randomly initialised chat model of
``--shape``, one CPU inference server, disk weight sync) on one unsharded trainer rank (the default job's
allocation; ``--ranks 2`` for FSDP2 over gloo, scale_real_model's, where a full 494M model no longer fits this
machine's 24 GiB), run once per variant
with nothing else changed: ``full`` trains every weight, ``lora`` adds ``train.lora.rank=RANK``,
``lora-distributed`` also ``train.weight_sync=distributed`` (the adapter's tensors in the body of
``/load_lora_adapter_from_tensors``). While a job runs, every process's resident memory is sampled twice a second
(``scale_real_model.run_sampled``), and ``scale_real_model.report`` prints every process's peak and every step's
times. Then, one row per variant, it prints the largest trainer rank's and the server's peak, the mean
of the steps' ``time_step_s``, ``time_train_s`` (with disk sync the step's last train call also writes the
servers' export) and ``time_sync_s`` from metrics.jsonl, and the bytes one sync moves, measured from what the run
wrote: with disk sync the last export the servers loaded (``weights/v*``: the model's safetensors, or the
adapter's PEFT directory); otherwise the tensors of the final export (``final/*.safetensors``: the same tensors a
distributed push sends, which the request body carries base64-encoded). Results: bench/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _jobs import JobResult, table
from scale_real_model import add_job_args, job_overrides, make_inputs, report, run_sampled

VARIANTS = {  # name -> the overrides that make it; every variant runs the same job otherwise
    "full": lambda rank: [],
    "lora": lambda rank: [f"train.lora.rank={rank}"],
    "lora-distributed": lambda rank: [f"train.lora.rank={rank}", "train.weight_sync=distributed"],
}
HEADER = ("variant", "trainer peak GiB", "server peak GiB", "step s", "train s", "export s", "sync s", "sync MiB", "of")


def peak_gib(peaks: dict[int, tuple[str, int]], role: str) -> float:
    """The largest peak of the processes whose role starts with ``role`` ("trainer rank": over the ranks)."""
    return max((rss for r, rss in peaks.values() if r.startswith(role)), default=0) / 2**30


def sync_bytes(run_dir: Path) -> tuple[int, str]:
    """The bytes one weight sync moved, from what the run wrote, and where they were measured."""
    exports = sorted((run_dir / "weights").glob("v*"))
    if exports:  # disk sync: the servers loaded this directory; older ones were deleted once they held it
        files = [f for f in exports[-1].rglob("*") if f.is_file()]
        return sum(f.stat().st_size for f in files), f"weights/{exports[-1].name}/"
    tensors = list((run_dir / "final").glob("*.safetensors"))  # model.safetensors, or adapter_model.safetensors
    if not tensors:
        raise SystemExit(f"{run_dir}: no weights/v* export and no final/*.safetensors to measure a sync by")
    return sum(f.stat().st_size for f in tensors), "final/*.safetensors"


def row(name: str, result: JobResult, peaks: dict[int, tuple[str, int]]) -> list:
    def mean(key: str) -> float | str:  # "" where no step logged it (no export with distributed sync)
        values = [m[key] for m in result.metrics if key in m]
        return statistics.fmean(values) if values else ""

    size, source = sync_bytes(result.run_dir)
    trainer, server = peak_gib(peaks, "trainer rank"), peak_gib(peaks, "inference server")
    times = [mean(k) for k in ("time_step_s", "time_train_s", "time_weights_export_s", "time_sync_s")]
    return [name, trainer, server, *times, size / 2**20, source]


def ratios(rows: list[list]) -> None:
    """Each variant against ``full``: trainer memory, step time, sync bytes."""
    base = next((r for r in rows if r[0] == "full"), None)
    for r in rows:
        if base is not None and r is not base:
            print(
                f"{r[0]} / full: trainer peak {r[1] / base[1]:.2f}x, step {r[3] / base[3]:.2f}x, "
                f"train {r[4] / base[4]:.2f}x, sync {r[6] / base[6]:.2f}x, sync bytes {r[7] / base[7]:.2g}x"
            )


def run(args: argparse.Namespace, work: Path) -> None:
    model, data = make_inputs(args, work)
    base = job_overrides(args, model, data)
    rows = []
    for name in args.variants:
        print(f"\n## {name}", flush=True)
        result, peaks = run_sampled([*base, *VARIANTS[name](args.rank), *args.overrides], work, name, args.timeout)
        report(peaks, result)  # scale_real_model's: every process's peak, every step's times
        rows.append(row(name, result, peaks))
    sizes = f"{args.steps} steps of {args.prompts} prompts x {args.group}, {args.new_tokens} new tokens"
    print(f"\n## side by side: {args.shape}, {sizes}; the steps' means")
    print(table(HEADER, rows))
    ratios(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_args(parser)
    # full fine-tuning of 494M parameters on 2 ranks no longer fits 24 GiB: each rank peaked at 10.8 GiB (OOM-killed)
    parser.set_defaults(ranks=1)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rank", type=int, default=8, help="train.lora.rank of the LoRA variants")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a job may take")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="the tiny shape, full and lora: measures nothing")
    parser.add_argument("overrides", nargs="*", help="hpcrl overrides for every variant, after --")
    args = parser.parse_args()
    if args.quick:
        args.shape, args.variants = "tiny", ["full", "lora"]
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        run(args, args.keep)
        return
    with tempfile.TemporaryDirectory(prefix="hpcrl-lora-") as work:
        run(args, Path(work))


if __name__ == "__main__":
    main()
