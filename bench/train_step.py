"""One update of the trainer in one process: ``Engine.train_step`` unsharded and under FSDP2, against plain PyTorch.

    python bench/train_step.py [--runs 5] [--calls 10] [--threads 2] [--quick]

World size 1 (gloo), the default job's tiny model (``hpcrl.models.tiny``) and a batch shaped like one of its
updates: 256 sequences of a 5-token prompt and 2 completion tokens (every fourth ends after 1), GRPO's token
loss. Side by side in each run, each timed over ``--calls`` calls after two warm-up calls:

- engine: ``Engine.train_step`` as a one-rank float32 trainer runs it, on the unsharded model;
- engine, FSDP2: the same with the model wrapped by ``fully_shard`` per decoder layer and at the root, as on
  more ranks (what one rank ran before 2026-12-02);
- plain: the same forward, loss, backward, gradient clip and fused AdamW written out, no engine.

Prints ms per update (median over runs) and each against plain. ``--quick``: 2 runs of 2 calls on 32
sequences, to check the script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from _jobs import table

from hpcrl.config.schema import TrainConfig
from hpcrl.models.tiny import make_tiny_model
from hpcrl.train import engine as engine_module
from hpcrl.train.batch import Sequence
from hpcrl.train.dist import init_distributed
from hpcrl.train.engine import Engine

TRAIN = TrainConfig(lr=5e-4, grad_clip=1.0)
DEFAULT_JOB_MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512}  # model/tiny.yaml


def batch(size: int) -> list[Sequence]:
    sequences = []
    for i in range(size):
        completion = 1 if i % 4 == 0 else 2
        ids = [2 + (7 * i + j) % 13 for j in range(5 + completion)]
        sequences.append(Sequence(input_ids=ids, loss_mask=[0] * 5 + [1] * completion, advantage=(-1.0) ** i))
    return sequences


def token_loss(logprobs, mb, norm):
    mask = mb.loss_mask
    return -(mb.advantages[:, None] * logprobs * mask).sum() / norm.tokens, {}


def engine_update(model: str, sharded: bool) -> Callable[[list[Sequence]], object]:
    shards = engine_module._shards
    engine_module._shards = (lambda world_size, mp_policy: True) if sharded else shards
    try:
        engine = Engine(model, TRAIN, dist=init_distributed())
        engine.setup()
    finally:
        engine_module._shards = shards
    return lambda sequences: engine.train_step(sequences, token_loss)


def plain_update(model: str) -> Callable[[list[Sequence]], object]:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(net.parameters(), lr=TRAIN.lr, weight_decay=TRAIN.weight_decay, fused=True)

    def update(sequences: list[Sequence]) -> None:
        width = max(len(s.input_ids) for s in sequences)
        ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask, loss_mask = torch.zeros_like(ids), torch.zeros((len(sequences), width - 1))
        for row, seq in enumerate(sequences):
            ids[row, : len(seq.input_ids)] = torch.tensor(seq.input_ids)
            mask[row, : len(seq.input_ids)] = 1
            loss_mask[row, : len(seq.loss_mask) - 1] = torch.tensor(seq.loss_mask[1:], dtype=torch.float32)
        advantages = torch.tensor([s.advantage for s in sequences])
        logits = net(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        logprobs = (logits.gather(-1, ids[:, 1:, None]) - logits.logsumexp(-1, keepdim=True)).squeeze(-1)
        (-(advantages[:, None] * logprobs * loss_mask).sum() / loss_mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), TRAIN.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return update


def time_calls(update: Callable[[list[Sequence]], object], sequences: list[Sequence], calls: int) -> float:
    for _ in range(2):
        update(sequences)
    start = time.perf_counter()
    for _ in range(calls):
        update(sequences)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, as the default job's one rank has")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    runs, calls, size = (2, 2, 32) if args.quick else (args.runs, args.calls, 256)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, **DEFAULT_JOB_MODEL))
        ways = {
            "engine": engine_update(model, sharded=False),
            "engine, FSDP2": engine_update(model, sharded=True),
            "plain": plain_update(model),
        }
        sequences = batch(size)
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(runs):
            for way, update in ways.items():
                times[way].append(time_calls(update, sequences, calls))
    print(f"{size} sequences, {args.threads} torch threads, {runs} runs of {calls} calls", file=sys.stderr)
    ms = {way: statistics.median(t) for way, t in times.items()}
    rows = [[way, round(ms[way], 1), round(ms[way] / ms["plain"], 2)] for way in ways]
    print(table(["way", "ms per update", "/ plain"], rows))
    print(f"engine, FSDP2 / engine: {ms['engine, FSDP2'] / ms['engine']:.2f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
