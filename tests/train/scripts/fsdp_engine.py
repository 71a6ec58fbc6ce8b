"""torchrun script behind tests/train/test_engine_fsdp.py: trains the tiny model and writes what it got.

    torchrun --standalone --nproc_per_node=N fsdp_engine.py MODEL_DIR OUT_DIR PHASE

Phases (every rank takes ``batch[rank::world]`` of the same seeded global batches):

- ``train``: for each batch kind, 5 steps from the initial weights -> ``<kind>_w<N>.safetensors`` (full
  state dict) and ``<kind>_w<N>.json`` (metrics per step). Kind ``uneven`` is one step in which rank 0
  gets 12 long sequences and rank 1 one short one (on 1 rank: all 13). On more than one rank it also
  writes ``logprobs_check.json`` (sharded ``token_logprobs`` vs the plain HF model), exports the ``varying``
  model (after step 5) to ``export/``, saves a checkpoint after
  step 5 to ``ckpt/``, then takes step 6 -> ``step6_before.{json,safetensors}``.
  Kind ``lora`` trains LoRA adapters (``train.lora``) on the ``varying`` batches: ``lora_w<N>.safetensors`` holds
  the adapter's tensors (PEFT names), ``lora_w<N>_full.safetensors`` the whole model (frozen base included) and
  ``lora_w<N>_rank<R>.json`` the metrics and whether every frozen weight's ``.grad`` stayed None,
  ``lora_reference_w<N>_rank<R>.json`` how far the KL reference (``BaseReference``: the adapters off) is from the
  plain base model's logprobs; on more than one rank it then saves ``lora_ckpt/`` and takes step 6 ->
  ``lora_step6_before.{json,safetensors}``.
- ``resume``: a fresh engine loads ``ckpt/`` (written by 2 ranks) and takes step 6 ->
  ``step6_after_w<N>.{json,safetensors}``; on 1 rank the engine is the unsharded model. A LoRA engine does the
  same from ``lora_ckpt/`` -> ``lora_step6_after_w<N>.{json,safetensors}`` (adapter tensors).
"""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from hpcrl.config.schema import LoRAConfig, TrainConfig
from hpcrl.logs import setup_logging
from hpcrl.train.batch import MicroBatch, Normalizer, Sequence
from hpcrl.train.checkpoint import load_checkpoint, save_checkpoint
from hpcrl.train.dist import DistInfo, init_distributed
from hpcrl.train.engine import Engine
from hpcrl.train.microbatch import pack

STEPS = 5
VOCAB = 99
TRAIN = TrainConfig(
    lr=1e-3, weight_decay=0.01, grad_clip=1.0, warmup_steps=2, lr_schedule="cosine", micro_batch_tokens=64
)
TOTAL_STEPS = 10
LORA = replace(TRAIN, lora=LoRAConfig(rank=4, alpha=8.0))
TEMPERATURE = 0.8


def make_sequence(rng: random.Random, length: int, prompt: int) -> Sequence:
    ids = [rng.randrange(3, VOCAB) for _ in range(length)]
    return Sequence(input_ids=ids, loss_mask=[0] * prompt + [1] * (length - prompt), advantage=rng.gauss(0, 1))


def global_batch(kind: str, step: int) -> list[Sequence]:
    rng = random.Random(f"{kind}-{step}")
    if kind == "uniform":
        return [make_sequence(rng, 12, 4) for _ in range(8)]
    if kind == "varying":
        return [make_sequence(rng, (n := rng.randint(5, 40)), rng.randint(1, min(6, n - 1))) for _ in range(10)]
    if kind == "uneven":
        return [make_sequence(rng, 60, 10) for _ in range(12)] + [make_sequence(rng, 5, 2)]
    raise ValueError(kind)


def share(batch: list[Sequence], kind: str, info: DistInfo) -> list[Sequence]:
    if info.world_size == 1:
        return batch
    if kind == "uneven":
        return batch[:12] if info.rank == 0 else batch[12:] if info.rank == 1 else []
    return batch[info.rank :: info.world_size]


def token_mean_loss(logprobs: torch.Tensor, mb: MicroBatch, norm: Normalizer):
    """REINFORCE with the DAPO-style token mean over the global batch."""
    mask = mb.loss_mask
    loss = -(mb.advantages[:, None] * logprobs * mask).sum() / norm.tokens
    return loss, {"logprob_mean": float((logprobs.detach() * mask).sum() / mask.sum().clamp(min=1))}


def seq_mean_loss(logprobs: torch.Tensor, mb: MicroBatch, norm: Normalizer):
    """REINFORCE with GRPO's mean over sequences of each sequence's token mean."""
    mask = mb.loss_mask
    per_seq = (mb.advantages[:, None] * logprobs * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return -per_seq.sum() / norm.sequences, {}


LOSSES = {"uniform": token_mean_loss, "varying": seq_mean_loss, "uneven": token_mean_loss, "lora": seq_mean_loss}


def new_engine(model: str, info: DistInfo, train: TrainConfig = TRAIN) -> Engine:
    engine = Engine(model, train, dist=info, total_steps=TOTAL_STEPS)
    engine.setup()
    return engine


def run_steps(engine: Engine, kind: str, steps: range, info: DistInfo) -> list[dict]:
    metrics = []
    batches = "varying" if kind == "lora" else kind  # LoRA trains on the varying batches
    for step in steps:
        mine = share(global_batch(batches, step), batches, info)
        result = engine.train_step(mine, LOSSES[kind], TEMPERATURE)
        result["local_packed"] = len(pack([len(s.input_ids) for s in mine], TRAIN.micro_batch_tokens))
        metrics.append(result)
    return metrics


def write(out: Path, name: str, engine: Engine, metrics: list[dict], info: DistInfo) -> None:
    state = engine.full_state_dict()  # collective; {} on ranks other than 0
    (out / f"{name}_rank{info.rank}.json").write_text(json.dumps(metrics))
    if info.is_main:
        save_file({k: v.clone() for k, v in state.items()}, out / f"{name}.safetensors")


def write_adapter(out: Path, name: str, engine: Engine, metrics: list[dict], info: DistInfo) -> None:
    """The adapter's tensors (``adapter_tensors``: collective) and the metrics, with whether every frozen weight's
    ``.grad`` stayed None on this rank."""
    tensors = engine.adapter_tensors()
    frozen = [p for p in engine.require_setup()[0].parameters() if not p.requires_grad]
    for row in metrics:
        row["frozen_grads_none"] = bool(frozen) and all(p.grad is None for p in frozen)
    (out / f"{name}_rank{info.rank}.json").write_text(json.dumps(metrics))
    if info.is_main:
        save_file({k: v.clone() for k, v in tensors.items()}, out / f"{name}.safetensors")


def lora_phase(model: str, out: Path, info: DistInfo) -> None:
    world = info.world_size
    engine = new_engine(model, info, LORA)
    metrics = run_steps(engine, "lora", range(STEPS), info)
    write_adapter(out, f"lora_w{world}", engine, metrics, info)
    state = engine.full_state_dict()
    if info.is_main:
        save_file({k: v.clone() for k, v in state.items()}, out / f"lora_w{world}_full.safetensors")
    check_reference(engine, model, out, info)
    if world > 1:
        save_checkpoint(engine, out / "lora_ckpt")
        write_adapter(out, "lora_step6_before", engine, run_steps(engine, "lora", range(STEPS, STEPS + 1), info), info)


def check_gather(engine: Engine, out: Path, info: DistInfo) -> None:
    """``gather.json``: whether ``full_state_dict``'s one all-gather per dtype gives torch's own full state dict
    (``get_model_state_dict``, one collective per tensor) bit for bit, and the tensors whose rows split unevenly."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    ours = engine.full_state_dict()
    model, _ = engine.require_setup()
    theirs = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        same = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        uneven = sorted(k for k, v in theirs.items() if v.dim() and v.shape[0] % info.world_size)
        (out / "gather.json").write_text(json.dumps({"same": same, "tensors": len(ours), "uneven": uneven}))


def check_reference(engine: Engine, model: str, out: Path, info: DistInfo) -> None:
    """The trained LoRA engine's KL reference against the plain base model, and against the policy itself."""
    from hpcrl.train.lora_reference import BaseReference

    batch = global_batch("varying", 0)[:4]
    _, _, manual = plain_logprobs(model, batch)
    reference = BaseReference(engine).sequence_logprobs(batch, TEMPERATURE)
    policy = engine.sequence_logprobs(batch, TEMPERATURE)
    diff, moved = 0.0, 0.0
    for row, (ref, pol) in enumerate(zip(reference, policy, strict=True)):
        n = len(ref) - 1
        diff = max(diff, float((torch.tensor(ref[1:]) - manual[row, :n]).abs().max()))
        moved = max(moved, float((torch.tensor(ref) - torch.tensor(pol)).abs().max()))
    result = {"max_abs_diff": diff, "policy_moved": moved}
    (out / f"lora_reference_w{info.world_size}_rank{info.rank}.json").write_text(json.dumps(result))


def plain_logprobs(model: str, batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` right-padded (ids, mask) and the plain Hugging Face model's tempered token logprobs of it."""
    from transformers import AutoModelForCausalLM

    width = max(len(s.input_ids) for s in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(batch):
        ids[row, : len(seq.input_ids)] = torch.tensor(seq.input_ids)
        mask[row, : len(seq.input_ids)] = 1
    plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = plain(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return ids, mask, torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def check_logprobs(engine: Engine, model: str, out: Path, info: DistInfo) -> None:
    batch = global_batch("varying", 0)[:4]
    ids, mask, manual = plain_logprobs(model, batch)
    sharded = engine.token_logprobs(ids, mask, TEMPERATURE)
    valid = mask[:, 1:].bool()
    result = {"max_abs_diff": float((sharded - manual)[valid].abs().max()), "shape": list(sharded.shape)}
    (out / f"logprobs_check_rank{info.rank}.json").write_text(json.dumps(result))


def train_phase(model: str, out: Path, info: DistInfo) -> None:
    world = info.world_size
    for kind in ("uniform", "uneven", "varying"):
        engine = new_engine(model, info)
        if kind == "varying" and world > 1:
            check_logprobs(engine, model, out, info)
        steps = range(1) if kind == "uneven" else range(STEPS)
        write(out, f"{kind}_w{world}", engine, run_steps(engine, kind, steps, info), info)
    lora_phase(model, out, info)
    if world == 1:
        return
    check_gather(engine, out, info)
    engine.export_hf(out / "export")
    save_checkpoint(engine, out / "ckpt")
    write(out, "step6_before", engine, run_steps(engine, "varying", range(STEPS, STEPS + 1), info), info)


def resume_phase(model: str, out: Path, info: DistInfo) -> None:
    engine = new_engine(model, info)
    load_checkpoint(engine, out / "ckpt")
    write(
        out,
        f"step6_after_w{info.world_size}",
        engine,
        run_steps(engine, "varying", range(STEPS, STEPS + 1), info),
        info,
    )
    engine = new_engine(model, info, LORA)
    load_checkpoint(engine, out / "lora_ckpt")
    metrics = run_steps(engine, "lora", range(STEPS, STEPS + 1), info)
    write_adapter(out, f"lora_step6_after_w{info.world_size}", engine, metrics, info)


def main() -> None:
    model, out, phase = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    setup_logging("trainer", os.environ.get("RANK", "0"), "WARNING")
    torch.use_deterministic_algorithms(True)
    info = init_distributed(timeout_s=120)
    {"train": train_phase, "resume": resume_phase}[phase](model, out, info)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
