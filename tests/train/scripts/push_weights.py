"""torchrun script behind tests/train/test_weight_push.py: trains, pushes to a live server, records what it saw.

    torchrun --standalone --nproc_per_node=2 push_weights.py MODEL_DIR SERVER_ADDRESS GROUP_PORT OUT_DIR

Rank 0 plays the controller too (``InferenceClient`` calls, run in a helper thread where they must overlap
the collectives). Each phase first trains a few steps towards its own completion, so the server's weights
are stale, then pushes:

- ``disk``: ``push_to_disk`` -> ``/update_weights_from_disk`` with weight_version 1; then ``export_hf`` of the
  same weights, the Hugging Face directory transformers loads for the comparison (the push writes the weights
  alone), and whether the pushed tensors are that export's, bit for bit.
- ``group``: rank 0 hosts the group (``host_weight_group``, on GROUP_PORT of this node), then
  ``/init_weights_update_group`` beside ``join_weight_group``, then a session: ``/begin_weight_update``,
  one ``/update_weights_from_distributed`` (version 2) per bucket of at most BUCKET_BYTES beside
  ``push_over_group`` on every rank, ``/end_weight_update``; with the root's parameters left unsharded by a
  forward and ``weight_specs`` called on rank 0 alone beforehand.

For each phase rank 0 records the server's greedy completions before and after the push, those of
transformers' ``generate`` on the exported trainer model, the largest gap between the server's logprobs and
a forward of that model, and ``/model_info``'s weight_version; every rank writes ``OUT_DIR/result_rank<R>.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from hpcrl.config.schema import TrainConfig
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.weight_layout import buckets
from hpcrl.logs import setup_logging
from hpcrl.train.batch import MicroBatch, Normalizer, Sequence
from hpcrl.train.dist import DistInfo, init_distributed
from hpcrl.train.engine import Engine
from hpcrl.train.weight_push import (
    host_weight_group,
    join_weight_group,
    leave_weight_group,
    push_over_group,
    push_to_disk,
    weight_specs,
)

PROMPTS = ["3+4=", "hello", "a", "The cat", "12+7=", "xy"]
TARGETS = {"disk": "qrsqrsqrsqrs", "group": "0909090909"}  # what each phase trains the completions towards
STEPS = 4
MAX_NEW_TOKENS = 12
TRAIN = TrainConfig(lr=3e-3, grad_clip=1.0, micro_batch_tokens=64)
HTTP_TIMEOUT_S = 60.0
HOST = "127.0.0.1"
GROUP_WORLD_SIZE = 2  # trainer rank 0 and the one server's one rank
BUCKET_BYTES = 64 << 10  # several calls for the tiny model: the bucket boundaries are exercised


def sft_loss(logprobs: torch.Tensor, mb: MicroBatch, norm: Normalizer):
    return -(mb.advantages[:, None] * logprobs * mb.loss_mask).sum() / norm.tokens, {}


def train(engine: Engine, tok, target: str, info: DistInfo) -> None:
    batch = []
    for prompt in PROMPTS:
        prompt_ids, target_ids = tok(prompt)["input_ids"], tok(target)["input_ids"]
        ids = prompt_ids + target_ids
        batch.append(Sequence(ids, [0] * len(prompt_ids) + [1] * len(target_ids), advantage=1.0))
    for _ in range(STEPS):
        engine.train_step(batch[info.rank :: info.world_size], sft_loss)


def prompt_ids(tok) -> list[list[int]]:
    return [tok(p)["input_ids"] for p in PROMPTS]


async def _with_client(address: str, coro_fn):
    async with InferenceClient([address], request_timeout_s=HTTP_TIMEOUT_S) as client:
        return await coro_fn(client)


def call(address: str, coro_fn):
    """``coro_fn(client)`` on a fresh event loop with a client of the one server; its result."""
    return asyncio.run(_with_client(address, coro_fn))


def in_thread(pool: ThreadPoolExecutor, address: str, coro_fn) -> Future:
    """``call`` in ``pool``: an HTTP request that must overlap this thread's collectives."""
    return pool.submit(call, address, coro_fn)


def server_greedy(address: str, tok) -> tuple[list[list[int]], list[list[float]], str]:
    """The server's greedy completions of PROMPTS, their logprobs, and its weight_version."""

    async def ask(client):
        params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
        results = await client.generate_many(prompt_ids(tok), params)
        version = (await client.model_info())[address]["weight_version"]
        return [r.output_ids for r in results], [r.logprobs for r in results], version

    return call(address, ask)


def reference(model_dir: Path, tok, outputs: list[list[int]], logprobs: list[list[float]]) -> dict:
    """Greedy ``generate`` of the exported model, and its logprobs of the server's completions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy, gap = [], 0.0
    with torch.no_grad():
        for ids, out, got in zip(prompt_ids(tok), outputs, logprobs, strict=True):
            new = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, len(ids) :]
            new = new.tolist()
            greedy.append(new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new)
            full = torch.tensor([ids + out])
            table = torch.log_softmax(model(full).logits[0, :-1].float(), dim=-1)
            expected = [table[len(ids) - 1 + i, t].item() for i, t in enumerate(out)]
            gap = max([gap, *(abs(a - b) for a, b in zip(got, expected, strict=True))])
    return {"reference": greedy, "max_logprob_gap": gap}


def disk_phase(engine: Engine, tok, address: str, out: Path, info: DistInfo) -> dict:
    before = server_greedy(address, tok)[0] if info.is_main else None
    train(engine, tok, TARGETS["disk"], info)
    start = time.monotonic()
    path = push_to_disk(engine, out / "pushed_disk")
    if info.is_main:
        call(address, lambda c: c.update_weights_from_disk(str(path), weight_version=1))
    seconds = time.monotonic() - start
    full = engine.export_hf(out / "trainer_after_disk")  # the same weights with config and tokenizer, to compare
    if not info.is_main:
        return {}
    after, logprobs, version = server_greedy(address, tok)
    pushed, exported = load_file(path / "model.safetensors"), load_file(full / "model.safetensors")
    same = pushed.keys() == exported.keys() and all(torch.equal(pushed[k], exported[k]) for k in pushed)
    phase = {"before": before, "after": after, "version": version, "seconds": seconds}
    phase |= {"pushed_files": sorted(p.name for p in path.iterdir()), "pushed_is_the_export": same}
    return phase | reference(full, tok, after, logprobs)


def forward(engine: Engine, tok) -> None:
    """A forward-only pass: FSDP2 leaves the root's parameters unsharded after it (collective)."""
    ids = torch.tensor([tok("hello world")["input_ids"]])
    engine.token_logprobs(ids, torch.ones_like(ids))


def group_phase(engine: Engine, tok, address: str, port: int, out: Path, info: DistInfo) -> dict:
    before = server_greedy(address, tok)[0] if info.is_main else None
    train(engine, tok, TARGETS["group"], info)
    forward(engine, tok)
    specs = weight_specs(engine) if info.is_main else []  # rank 0 alone, with the root's parameters unsharded
    forward(engine, tok)  # would hang or fail if weight_specs had resharded rank 0 alone
    calls = buckets(specs, BUCKET_BYTES)
    rendezvous = host_weight_group(engine, HOST, port, timeout_s=120)  # None on the other ranks

    async def init(client):
        assert rendezvous is not None
        return await client.init_weights_update_group(rendezvous.host, rendezvous.port, backend=rendezvous.backend)

    async def update(client):
        await client.begin_weight_update()
        for i, bucket in enumerate(calls):
            names, dtypes, shapes = zip(*bucket, strict=True)
            await client.update_weights_from_distributed(names, dtypes, shapes, 2, flush_cache=i == len(calls) - 1)
        await client.end_weight_update()

    async def destroy(client):
        await client.destroy_weights_update_group()

    with ThreadPoolExecutor(1) as pool:
        # the server joins inside its HTTP handler, rank 0 here, and each waits for the other
        joining = in_thread(pool, address, init) if info.is_main else None
        group = join_weight_group(engine, rendezvous, world_size=GROUP_WORLD_SIZE, timeout_s=120)  # None but on rank 0
        world = joining.result(timeout=HTTP_TIMEOUT_S) if joining else None
        start = time.monotonic()
        receiving = in_thread(pool, address, update) if info.is_main else None
        count = push_over_group(engine, group)  # every rank gathers; rank 0 also broadcasts
        if receiving:
            receiving.result(timeout=HTTP_TIMEOUT_S)
        seconds = time.monotonic() - start
        path = engine.export_hf(out / "trainer_after_group")  # the trainer's model now, to compare with
        if not info.is_main:
            return {"tensors": count, "group_is_none": group is None}
        assert group is not None
        after, logprobs, version = server_greedy(address, tok)
        in_thread(pool, address, destroy).result(timeout=HTTP_TIMEOUT_S)
        leave_weight_group(group)
    return {
        "before": before,
        "after": after,
        "version": version,
        "tensors": count,
        "seconds": seconds,
        "world_size": world,
        "backend": group.backend,
        "specs": specs,
        "calls": len(calls),
        # the same measure against the weights the server held before: shows the gap above is no accident
        "stale_logprob_gap": reference(out / "trainer_after_disk", tok, after, logprobs)["max_logprob_gap"],
    } | reference(path, tok, after, logprobs)


def main() -> None:
    from hpcrl.models.tokenizer import load_tokenizer

    model, address, port, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    setup_logging("trainer", os.environ.get("RANK", "0"), "WARNING")
    info = init_distributed(timeout_s=120)
    engine = Engine(model, TRAIN, dist=info)
    engine.setup()
    tok = load_tokenizer(model)
    result = {"specs_at_setup": weight_specs(engine)}
    result["disk"] = disk_phase(engine, tok, address, out, info)
    result["group"] = group_phase(engine, tok, address, port, out, info)
    (out / f"result_rank{info.rank}.json").write_text(json.dumps(result))
    dist.barrier(group=info.meta_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
