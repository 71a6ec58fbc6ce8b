"""torchrun script behind tests/train/test_value_engine.py: the critic's engine on 1 or 2 ranks.

    torchrun --standalone --nproc_per_node=N value_engine.py MODEL_DIR OUT_DIR

Every rank takes ``batch[rank::world]`` of the same seeded batch of sequences with GAE returns and old values.
It writes ``w<N>.json``: the values before any step (per sequence, aligned with input_ids), the value-loss
metrics of 6 steps, the values after them; ``w<N>.safetensors``: the full state dict after them; and on 2 ranks
it also exports the critic to ``export/`` and saves a checkpoint to ``ckpt/`` that a fresh engine loads
(``reloaded_values``), then one more step on both (``step7``), which must agree.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import replace
from pathlib import Path

from safetensors.torch import save_file

from hpcrl.config.schema import AlgorithmConfig, TrainConfig
from hpcrl.train.batch import Sequence
from hpcrl.train.checkpoint import load_checkpoint, save_checkpoint
from hpcrl.train.dist import init_distributed
from hpcrl.train.loss import make_value_loss_fn
from hpcrl.train.value_engine import ValueEngine

TRAIN = TrainConfig(lr=1e-9, critic_lr=3e-3, grad_clip=1.0, micro_batch_tokens=48)  # lr: the policy's, unused
ALGORITHM = AlgorithmConfig(loss_agg="token_mean", value_clip=0.5)
STEPS = 6


def batch() -> list[Sequence]:
    """Sequences whose return is +1 after token 7 and -1 after token 8 at their first response position: a critic
    that learns separates them."""
    rng = random.Random(0)
    out = []
    for i in range(10):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(2, 5))]
        response = [7 if i % 2 else 8] + [rng.randrange(3, 40) for _ in range(rng.randint(1, 6))]
        n, p = len(prompt) + len(response), len(prompt)
        target = 1.0 if i % 2 else -1.0
        mask = [0] * p + [1] * (n - p)
        out.append(Sequence(prompt + response, mask, returns=[target * m for m in mask], old_values=[0.0] * n))
    return out


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    info = init_distributed()
    world, mine = info.world_size, batch()[info.rank :: info.world_size]
    engine = ValueEngine(model, TRAIN, dist=info, total_steps=10)
    engine.setup()
    loss_fn = make_value_loss_fn(ALGORITHM, max_new_tokens=8)
    result = {"lr": engine.train.lr, "before": engine.sequence_values(mine)}
    result["steps"] = [engine.train_step(mine, loss_fn) for _ in range(STEPS)]
    result["after"] = engine.sequence_values(mine)
    state = engine.full_state_dict()
    if info.is_main:
        save_file({k: v.clone() for k, v in state.items()}, out / f"w{world}.safetensors")
    if world > 1:
        engine.export_hf(out / "export")
        save_checkpoint(engine, out / "ckpt")
        fresh = ValueEngine(model, TRAIN, dist=info, total_steps=10)
        fresh.setup()
        load_checkpoint(fresh, out / "ckpt")
        result["reloaded_values"] = fresh.sequence_values(mine)
        result["reloaded_step"] = fresh.step
        moved = [replace(s, old_values=v) for s, v in zip(mine, result["after"], strict=True)]
        result["step7"] = [engine.train_step(moved, loss_fn)["loss"], fresh.train_step(moved, loss_fn)["loss"]]
    (out / f"w{world}_rank{info.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
