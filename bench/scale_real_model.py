"""Scale check: a model of Qwen2.5-0.5B's shape through the whole loop of ``experiment=gsm8k`` on this machine.

    python bench/scale_real_model.py [--steps 2] [--prompts 2] [--group 4] [--new-tokens 32] [--shape qwen2.5-0.5b]
    python bench/scale_real_model.py --quick      # the tiny shape, to check the script (tests/bench)

Makes a Qwen2-shaped model of 494M parameters, randomly initialised, behind the BPE chat tokenizer of
``hpcrl/models/chat.py`` (``python -m hpcrl.models.chat --shape qwen2.5-0.5b``), writes GSM8K-style rows, and runs
``python -m hpcrl.main experiment=gsm8k model.path=... 'dataset.train_files=[...]'`` with a short budget (a few
prompts a step, short generations) on one CPU inference server and two FSDP ranks over gloo (the allocation
README's figures were measured with; the default job has one rank), the controller, the reward processes. While it
runs, the resident memory of every process of the job's tree is sampled twice a second; it prints each process's
peak, the steps' times (rollout, train, weight sync) and the summary line. A random model writes nonsense, so
rewards are 0: what is measured is that the real-model path holds at this size, and what it costs. Results:
README.md ("Scale check") and bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import psutil
from _jobs import JobResult, run_job, table

# what a process of a job is, by its command line
ROLES = (
    ("hpcrl.main", "controller"),
    ("hpcrl.inference.worker", "server worker"),
    ("hpcrl.inference.server", "inference server"),
    ("torch.distributed.run", "torchrun"),
    ("torchrun", "torchrun"),
    ("hpcrl.train.worker", "trainer rank"),
    ("hpcrl.reward", "reward process"),
    ("multiprocessing", "reward process"),
)


def write_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """GSM8K-style rows: a word problem and its worked answer ending in ``#### N``."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            a, b = rng.randint(2, 60), rng.randint(2, 60)
            question = f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
            f.write(json.dumps({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
    return path


def role_of(proc: psutil.Process) -> str:
    try:
        cmdline = " ".join(proc.cmdline())
        env_rank = proc.environ().get("RANK", "")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    for needle, role in ROLES:
        if needle in cmdline:
            return f"{role} {env_rank}".strip() if role == "trainer rank" else role
    return cmdline[:40]


def sample(root: psutil.Process, peaks: dict[int, tuple[str, int]]) -> None:
    """Record each process's resident set size, keeping its peak, under its role."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            rss = p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
        known, peak = peaks.get(p.pid, (None, 0))
        role = role_of(p)
        if role == "?":  # gone meanwhile
            role = known or role
        elif role != known:  # first seen, or a child seen between its fork and its exec is the program it ran
            peak = 0
        peaks[p.pid] = (role, max(peak, rss))


def make_inputs(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The chat model of ``args.shape`` and the GSM8K-style rows, written under ``work``: (model dir, rows file)."""
    from hpcrl.models.chat import make_chat_model, parameter_count

    t0 = time.monotonic()
    model = make_chat_model(work / "model", shape=args.shape, tokenizer_vocab=4000, seed=0)
    print(f"made {model}: {parameter_count(model) / 1e6:.1f}M parameters in {time.monotonic() - t0:.0f} s", flush=True)
    return model, write_rows(work / "train.jsonl", 64)


def job_overrides(args: argparse.Namespace, model: Path, data: Path) -> list[str]:
    """The job's hpcrl overrides (all but where its run directory goes)."""
    return [
        "experiment=gsm8k",
        f"model.path={model}",
        f"model.dtype={args.dtype}",
        f"dataset.train_files=[{data}]",
        "dataset.holdout=4",  # rows of train.jsonl held out (dataset.eval_size is the synthetic task's)
        f"run.max_steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"algorithm.group_size={args.group}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "reward.workers=1",
        f"allocation.trainer.workers={args.ranks}",
        "checkpoint.every_steps=0",
        # a 494M-parameter model on CPU: loading, a disk weight sync and an evaluation each take minutes
        "cluster.roles.server.setup_timeout_s=1200",
        "cluster.roles.trainer.setup_timeout_s=1200",
        "rollout.request_timeout_s=1800",
    ]


@contextlib.contextmanager
def sampling(peaks: dict[int, tuple[str, int]]) -> Iterator[None]:
    """Sample the process trees this process starts (the job) into ``peaks`` twice a second until the block ends."""
    stop, me = threading.Event(), psutil.Process()

    def loop() -> None:
        while not stop.wait(0.5):
            for child in me.children():
                sample(child, peaks)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_sampled(overrides: list[str], work: Path, trial: str, timeout_s: float = 1800) -> tuple[JobResult, dict]:
    """``_jobs.run_job`` with every process's peak resident memory: (result, {pid: (role, peak bytes)})."""
    print(f"+ python -m hpcrl.main {' '.join(overrides)}", flush=True)
    peaks: dict[int, tuple[str, int]] = {}
    with sampling(peaks):
        result = run_job(overrides, work, trial, timeout_s=timeout_s)
    return result, peaks


def run(args: argparse.Namespace, work: Path) -> None:
    model, data = make_inputs(args, work)
    result, peaks = run_sampled(job_overrides(args, model, data), work, "scale")
    report(peaks, result)


def report(peaks: dict[int, tuple[str, int]], result: JobResult) -> None:
    by_role: dict[str, list[int]] = defaultdict(list)
    for role, peak in peaks.values():
        by_role[role].append(peak)
    rows = [(role, len(v), max(v) / 2**30) for role, v in sorted(by_role.items())]
    print("\npeak resident memory, by process (GiB; the largest of each kind):")
    print(table(("process", "count", "peak GiB"), rows))
    steps = [
        (m["step"], m["time_step_s"], m["time_rollout_wait_s"], m["time_train_s"], m["time_sync_s"])
        for m in result.metrics
    ]
    print("\nsteps (s):")
    print(table(("step", "step", "rollout wait", "train", "weight sync"), steps))
    print(f"\nwhole command: {result.process_s:.0f} s (start-up, two evaluations, the final export included)")
    print("summary:", json.dumps(result.summary))


def add_job_args(parser: argparse.ArgumentParser) -> None:
    """The job's sizes, as ``job_overrides`` reads them."""
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="hpcrl.models.chat.SHAPES")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="rollout.prompts_per_step")
    parser.add_argument("--group", type=int, default=4, help="algorithm.group_size")
    parser.add_argument("--new-tokens", type=int, default=32, help="rollout.max_new_tokens")
    parser.add_argument("--dtype", default="float32", help="model.dtype of the servers (bfloat16 is slow on CPUs)")
    parser.add_argument("--ranks", type=int, default=2, help="allocation.trainer.workers (2: FSDP2 over gloo)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_args(parser)
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="the tiny shape: checks the script, measures nothing")
    args = parser.parse_args()
    if args.quick:
        args.shape = "tiny"
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        run(args, args.keep)
        return
    with tempfile.TemporaryDirectory(prefix="hpcrl-scale-") as work:
        run(args, Path(work))


if __name__ == "__main__":
    main()
