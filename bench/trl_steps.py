"""hpcrl against TRL's GRPOTrainer step by step on the mod10 task: what agrees exactly and what does not.

    python bench/trl_steps.py [--seed 0] [--updates 6] [--prompts 64]                 # replay
    python bench/trl_steps.py --free [--seeds 0 1] [--steps 40] [--prompts 64]        # free runs, side by side

Needs TRL in the venv (``pip install trl==1.16.0``). Both start from the same model directory, made with
``make_tiny_model`` (``bench/_trl.py``: the default job's Qwen2, hidden 128, the mod10 alphabet, seeded by the
seed), with ``bench/_trl.py``'s ``trl_config`` on TRL's side, the settings ``bench/trl_grpo.py`` races with.

**Replay** (the default): TRL 1.16.0's ``GRPOTrainer`` runs ``--updates`` optimizer updates (half as many
generation batches of ``--prompts`` x 8; ``steps_per_generation=2``) while a subclass records, per update, the
minibatch it trained on (prompt and completion ids and masks, advantages, ``old_per_token_logps``), its loss,
the gradient norm before clipping, the learning rate the optimizer stepped with and the parameters after the
step; per generation batch, the rewards and advantages. Then hpcrl's own trainer, ``Engine.train_step`` on one
process with ``make_loss_fn`` of the grpo algorithm (clip 0.2, no KL, ``seq_mean_token_mean``; TrainConfig lr 5e-4
constant, clip 1.0, no decay), trains the same minibatches in the same order from the same initial weights, each
converted by ``to_sequences`` (unpadded prompt + completion, loss on the completion's tokens, TRL's advantage,
TRL's ``old_per_token_logps`` at the completion's positions). hpcrl is never reset to TRL's weights: a
difference that grows with the updates accumulates. Printed:

- settings: sampling (temperature, top-k, top-p, new tokens) and the optimizer (class, betas, eps, decay, fused)
  of both sides; what TRL's completions hold (lengths, EOS).
- per generation batch: mean reward, the share of groups whose rewards are all equal (``zero-std``), TRL's
  advantages against ``hpcrl.train.algorithms.compute_advantages`` (group_norm) of TRL's rewards: ``max |diff|``,
  ``TRL/hpcrl`` (the ratio over the nonzero advantages: min-max), and ``TRL recomputed`` (max |diff| of TRL's
  advantages to ``(r - mean) / (unbiased std + 1e-4)``, the formula read in TRL's source, to show it is that).
- per update: the minibatch (``size``, ``groups`` it draws from, ``split`` groups with samples in both of the
  generation batch's minibatches, mean completion ``len``), ``loss`` TRL and hpcrl, ``grad norm`` both (before
  clipping), ``lr`` both (the rate the optimizer stepped with), ``clip`` fraction both (TRL's
  ``clip_ratio/region_mean``, hpcrl's ``clip_frac``), ``max |dgrad|`` (the largest absolute difference of any
  element of the clipped gradient the optimizer applies), ``max |dparam|`` (of any parameter after the update) and
  ``where`` (the parameter holding that largest difference). Adam's first steps are ``lr * g / (|g| + 1e-8)``
  per element, so where ``|g|`` is near 1e-8 a rounding difference of the gradient moves a parameter by up to a
  good part of ``lr``: compare ``max |dparam|`` with ``lr``, ``max |dgrad|`` with the gradient's rounding.
  ``ms TRL`` and ``ms hpcrl``: the update's wall time in this process (TRL: from its ``compute_loss`` to its
  optimizer step's callback; hpcrl: its ``train_step`` call, micro-batching and metrics included), with their
  medians over the updates after the first.
- the same replay once more with hpcrl's own advantages (``group_norm`` of TRL's rewards at each minibatch's rows)
  in place of TRL's: its loss, grad norm and clip fraction, and the mean and max |difference| of its parameters
  to TRL's after each update (``mean |dparam| TRL adv``: the first replay's mean, for scale). This measures what
  the one difference in the update rule, the advantages' std, does to the weights.

**Free** (``--free``): per seed, hpcrl as ``python -m hpcrl.main`` with ``bench/trl_grpo.py``'s
``hpcrl_overrides`` (its ``metrics.jsonl``), then TRL in this process, logging every generation batch
(``logging_steps=2``: its means over the batch's two updates). Every 5th step side by side:

- ``reward``: the mean training reward (hpcrl ``reward_mean``, TRL ``reward``);
- ``zero-std``: the share of groups whose rewards are all equal (hpcrl ``reward_zero_std_frac``, TRL
  ``frac_reward_zero_std``);
- ``grad norm``: before clipping, the mean of the batch's two updates (hpcrl ``grad_norm``; TRL's recorded per
  update, as its logged ``grad_norm`` is the last update's);
- ``lr``: hpcrl ``lr``, TRL ``learning_rate``;
- ``clip``: the share of tokens clipped (hpcrl ``clip_frac``, TRL ``clip_ratio/region_mean``);
- ``len``: mean completion tokens, EOS included (hpcrl ``completion_len_mean``, TRL ``completions/mean_length``);
- ``gap``: hpcrl's ``mismatch_abs_max``, the largest |server logprob - trainer logprob| of a token before the
  first update; TRL has none to log: its ``old_per_token_logps`` are its trainer's own forward.

Then each run's first step with mean reward >= 0.8 and >= 0.9. Neither side logs a mean |advantage| (the replay
compares the advantages). The keys each side logged are listed. ``--steps`` caps both (generation batches).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _jobs import median, table
from _trl import ALPHABET, GROUP, LR, PROMPTS, TINY, make_trainer, trl_config

from hpcrl.train.batch import Sequence

REPLAY_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps")
THRESHOLDS = (0.8, 0.9)


# --- TRL's minibatch as hpcrl's sequences (no TRL needed) -------------------------------------------------------


def to_sequences(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
) -> list[Sequence]:
    """hpcrl ``Sequence``s of a TRL minibatch: prompts left-padded ``[B, P]``, completions right-padded ``[B, C]``
    with ``old_logprobs`` ``[B, C]`` (column j: completion token j's logprob), ``advantages`` ``[B]``.

    Each row becomes its prompt's real tokens then its completion's (the padding dropped); loss on the completion's
    tokens; ``old_logprobs`` aligned with ``input_ids`` (token t's entry at t, 0 on the prompt), as ``batch.py``
    says a rollout records them."""
    sequences = []
    for row in range(prompt_ids.shape[0]):
        prompt = prompt_ids[row][prompt_mask[row].bool()].tolist()
        keep = completion_mask[row].bool()
        completion = completion_ids[row][keep].tolist()
        if not prompt or not completion:
            raise ValueError(f"row {row}: {len(prompt)} prompt and {len(completion)} completion tokens, need >= 1 each")
        sequences.append(
            Sequence(
                input_ids=prompt + completion,
                loss_mask=[0] * len(prompt) + [1] * len(completion),
                advantage=float(advantages[row]),
                old_logprobs=[0.0] * len(prompt) + old_logprobs[row][keep].tolist(),
            )
        )
    return sequences


def split_groups(rows_a: torch.Tensor, rows_b: torch.Tensor, group: int) -> int:
    """Groups (rows // ``group``) with samples in both minibatches of one generation batch."""
    return len(set((rows_a // group).tolist()) & set((rows_b // group).tolist()))


# --- TRL, recorded ----------------------------------------------------------------------------------------------


@dataclass
class TrlRecord:
    updates: list[dict] = field(default_factory=list)  # per optimizer update: minibatch, loss, grad_norm, lr, params
    generations: list[dict] = field(default_factory=list)  # per generation batch: rewards, advantages (batch order)
    settings: dict = field(default_factory=dict)


def run_trl_recorded(model_dir: Path, seed: int, prompts: int, updates: int, work: Path) -> TrlRecord:
    """TRL's GRPOTrainer for ``updates`` optimizer updates, recording each (see the module docstring)."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    record = TrlRecord()

    class Recording(GRPOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            record.generations.append({"rewards": rewards[:, 0].detach().clone()})
            return rewards

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                record.generations[-1]["advantages"] = out["advantages"].detach().clone()
                out["row"] = torch.arange(out["advantages"].shape[0])  # shuffled and split along with the batch
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            started = time.perf_counter()  # the update's forward, backward, clipping and optimizer step from here
            inputs = dict(inputs)
            row = inputs.pop("row")
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            batch = {key: inputs[key].detach().clone() for key in REPLAY_KEYS}
            clip = self._metrics["train"]["clip_ratio/region_mean"][-1]
            record.updates.append(
                {"batch": batch, "row": row.clone(), "loss": float(loss.detach()), "clip": clip, "started": started}
            )
            return loss

        def _get_grad_norm(self, model, grad_norm=None):
            norm = super()._get_grad_norm(model, grad_norm=grad_norm)
            record.updates[-1]["grad_norm"] = float(norm)
            return norm

    class Steps(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kw):
            record.updates[-1]["lr"] = optimizer.param_groups[0]["lr"]
            record.updates[-1]["grads"] = {name: p.grad.detach().clone() for name, p in model.named_parameters()}

        def on_optimizer_step(self, args, state, control, model=None, **kw):
            update = record.updates[-1]
            update["seconds"] = time.perf_counter() - update["started"]
            update["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}

    config = trl_config(work / "trl", seed, prompts, updates // 2, logging_steps=10**6)
    trainer = make_trainer(Recording, model_dir, seed, config, [Steps()])
    trainer.train()
    record.settings = trl_settings(trainer)
    return record


def trl_settings(trainer) -> dict:
    gen = trainer.generation_config
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {
        "sampling": f"temperature {gen.temperature}, top_k {gen.top_k}, top_p {gen.top_p}, max_new_tokens "
        f"{gen.max_new_tokens}, do_sample {gen.do_sample}; logprobs at temperature {trainer.temperature}",
        "optimizer": optimizer_settings(optimizer),
        "loss": f"loss_type {trainer.loss_type}, epsilon {trainer.epsilon_low}/{trainer.epsilon_high}, "
        f"beta {trainer.beta}, scale_rewards {trainer.scale_rewards}, advantage std eps 1e-4 (source)",
    }


def optimizer_settings(optimizer) -> str:
    d = optimizer.defaults
    groups = [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups]
    return (
        f"{type(optimizer).__name__} lr {d['lr']}, betas {tuple(d['betas'])}, eps {d['eps']}, amsgrad {d['amsgrad']}, "
        f"fused {d.get('fused')}, foreach {d.get('foreach')}; groups (params, decay) {groups}"
    )


# --- hpcrl, replaying TRL's minibatches ---------------------------------------------------------------------------


def replay_hpcrl(model_dir: Path, record: TrlRecord, own_advantages: bool = False) -> tuple[list[dict], str]:
    """hpcrl's ``Engine.train_step`` on each of TRL's minibatches in order; per update its loss, grad norm, lr, clip
    fraction and the max |difference| of its parameters to TRL's after the same update. Also its optimizer's
    settings. ``own_advantages``: each sample's advantage is hpcrl's ``group_norm`` of TRL's rewards instead of
    TRL's (``advantages_of``)."""
    from hpcrl.config.schema import AlgorithmConfig, TrainConfig
    from hpcrl.train.dist import init_distributed
    from hpcrl.train.engine import Engine
    from hpcrl.train.loss import make_loss_fn

    engine = Engine(model_dir, TrainConfig(lr=LR, grad_clip=1.0, weight_decay=0.0), dist=init_distributed())
    engine.setup()
    loss_fn = make_loss_fn(AlgorithmConfig(), max_new_tokens=2)
    names = {id(p): name for name, p in engine.model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(optimizer, args, kwargs) -> None:  # the clipped gradient the step applies, as TRL's is recorded
        grads.update({names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]})

    engine.optimizer.register_step_pre_hook(keep_grads)
    results = []
    try:
        for i, update in enumerate(record.updates):
            batch = dict(update["batch"])
            if own_advantages:
                batch["advantages"] = advantages_of(record, i)
            sequences = to_sequences(*(batch[key] for key in REPLAY_KEYS))
            started = time.perf_counter()
            out = engine.train_step(sequences, loss_fn)
            seconds = time.perf_counter() - started
            ours = dict(engine.model.named_parameters())
            gaps = {name: (ours[name].detach() - p).abs() for name, p in update["params"].items()}
            dparam = {name: float(gap.max()) for name, gap in gaps.items()}
            worst = max(dparam, key=dparam.__getitem__)
            mean = float(sum(gap.sum() for gap in gaps.values()) / sum(gap.numel() for gap in gaps.values()))
            dgrad = max(float((grads[name] - g).abs().max()) for name, g in update["grads"].items())
            metrics = {k: out[k] for k in ("loss", "grad_norm", "lr", "clip_frac")}
            results.append(
                {**metrics, "max_dgrad": dgrad, "max_dparam": dparam[worst], "mean_dparam": mean, "worst": worst}
                | {"seconds": seconds}
            )
        settings = optimizer_settings(engine.optimizer)
    finally:
        torch.distributed.destroy_process_group()
    return results, settings


def advantages_of(record: TrlRecord, update: int) -> torch.Tensor:
    """hpcrl's advantages of update ``update``'s minibatch: ``group_norm`` of its generation batch's rewards, taken
    at the minibatch's rows (TRL shuffles the batch before splitting it; two updates a generation batch)."""
    rewards = record.generations[update // 2]["rewards"]
    return hpcrl_advantages(rewards)[record.updates[update]["row"]]


def hpcrl_advantages(rewards: torch.Tensor) -> torch.Tensor:
    from hpcrl.config.schema import AlgorithmConfig
    from hpcrl.train.algorithms import compute_advantages

    return compute_advantages(rewards.view(-1, GROUP), AlgorithmConfig(group_size=GROUP)).view(-1)


def trl_formula(rewards: torch.Tensor) -> torch.Tensor:
    grouped = rewards.view(-1, GROUP)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def generation_rows(record: TrlRecord) -> list[list]:
    rows = []
    for g, gen in enumerate(record.generations):
        rewards, trl = gen["rewards"], gen["advantages"]
        ours = hpcrl_advantages(rewards)
        nonzero = ours.abs() > 1e-6
        ratio = trl[nonzero] / ours[nonzero]
        zero_std = float((rewards.view(-1, GROUP).std(1) == 0).float().mean())
        span = f"{float(ratio.min()):.5f}-{float(ratio.max()):.5f}" if nonzero.any() else "-"
        rows.append(
            [
                g + 1,
                float(rewards.mean()),
                zero_std,
                f"{float((trl - ours).abs().max()):.3g}",
                span,
                f"{float((trl - trl_formula(rewards)).abs().max()):.3g}",
            ]
        )
    return rows


def update_rows(record: TrlRecord, ours: list[dict]) -> list[list]:
    rows = []
    for i, (trl, hp) in enumerate(zip(record.updates, ours, strict=True)):
        partner = record.updates[i ^ 1]["row"]  # the other minibatch of the same generation batch
        batch = trl["batch"]
        rows.append(
            [
                i + 1,
                int(batch["completion_ids"].shape[0]),
                len(set((trl["row"] // GROUP).tolist())),
                split_groups(trl["row"], partner, GROUP),
                float(batch["completion_mask"].sum(1).float().mean()),
                f"{trl['loss']:.7f}",
                f"{hp['loss']:.7f}",
                f"{trl['grad_norm']:.6f}",
                f"{hp['grad_norm']:.6f}",
                f"{trl['lr']:g}",
                f"{hp['lr']:g}",
                f"{trl['clip']:.4f}",
                f"{hp['clip_frac']:.4f}",
                f"{hp['max_dgrad']:.1e}",
                f"{hp['max_dparam']:.1e}",
                hp["worst"].removeprefix("model."),
                f"{1000 * trl['seconds']:.0f}",
                f"{1000 * hp['seconds']:.0f}",
            ]
        )
    return rows


def completion_summary(record: TrlRecord, eos_id: int) -> str:
    ids = torch.cat([u["batch"]["completion_ids"] for u in record.updates])
    mask = torch.cat([u["batch"]["completion_mask"] for u in record.updates]).bool()
    lengths = mask.sum(1)
    with_eos = ((ids == eos_id) & mask).any(1)
    counts = {int(n): int((lengths == n).sum()) for n in lengths.unique()}
    return (
        f"{ids.shape[0]} completions; lengths {counts}; {int(with_eos.sum())} end with EOS (id {eos_id}), which "
        "carries loss (completion_mask covers it)"
    )


def replay(args) -> None:
    from hpcrl.config.schema import RolloutConfig
    from hpcrl.models.tiny import make_tiny_model
    from hpcrl.models.tokenizer import load_tokenizer

    if args.updates < 2 or args.updates % 2:
        sys.exit(f"--updates must be even and >= 2 (two updates a generation batch), got {args.updates}")
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-trl-steps-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "model", seed=args.seed, characters=ALPHABET, **TINY)
        record = run_trl_recorded(model_dir, args.seed, args.prompts, args.updates, work)
        ours, hpcrl_optimizer = replay_hpcrl(model_dir, record)
        own, _ = replay_hpcrl(model_dir, record, own_advantages=True)
        eos_id = load_tokenizer(model_dir).eos_token_id
    rollout = RolloutConfig()
    print(f"seed {args.seed}, {args.prompts} prompts x {GROUP}, {args.updates} updates; TRL's minibatches replayed")
    print(f"TRL sampling: {record.settings['sampling']}")
    print(
        f"hpcrl sampling: temperature {rollout.temperature}, top_k {rollout.top_k}, top_p {rollout.top_p}, "
        "max_new_tokens 2 (hpcrl/conf/config.yaml); logprobs at the sampling temperature"
    )
    print(f"TRL loss: {record.settings['loss']}")
    print("hpcrl loss: grpo (group_norm, population std + 1e-6), seq_mean_token_mean, clip 0.2/0.2, no KL")
    print(f"TRL optimizer: {record.settings['optimizer']}")
    print(f"hpcrl optimizer: {hpcrl_optimizer}")
    print(f"TRL completions: {completion_summary(record, eos_id)}")
    print()
    header = ["batch", "reward", "zero-std", "adv max |diff|", "TRL/hpcrl", "TRL recomputed"]
    print(table(header, generation_rows(record)))
    print()
    header = ["update", "size", "groups", "split", "len", "loss TRL", "loss hpcrl", "grad norm TRL"]
    header += ["grad norm hpcrl", "lr TRL", "lr hpcrl", "clip TRL", "clip hpcrl"]
    header += ["max |dgrad|", "max |dparam|", "where", "ms TRL", "ms hpcrl"]
    print(table(header, update_rows(record, ours)))
    later = list(zip(record.updates, ours, strict=True))[1:]  # the first update warms both up
    trl_s, hpcrl_s = (sorted(u["seconds"] for u in side) for side in zip(*later, strict=True))
    print(
        f"an update (forward, backward, clipping, optimizer step) on the same minibatch in this process, "
        f"median of updates 2-{len(ours)}: "
        f"TRL {1000 * median(trl_s):.0f} ms, hpcrl {1000 * median(hpcrl_s):.0f} ms"
    )
    worst = max(r["max_dparam"] for r in ours)
    loss_gap = max(abs(t["loss"] - h["loss"]) for t, h in zip(record.updates, ours, strict=True))
    norm_gap = max(abs(t["grad_norm"] - h["grad_norm"]) for t, h in zip(record.updates, ours, strict=True))
    print(
        f"over the updates: max |dparam| {worst:.2e} ({worst / LR:.3f} of lr); max |dloss| {loss_gap:.2e}; "
        f"max |dgrad norm| {norm_gap:.2e}; max |dgrad| {max(r['max_dgrad'] for r in ours):.2e}"
    )
    print()
    print("the same replay with hpcrl's own advantages (group_norm of TRL's rewards), against TRL's weights:")
    header = ["update", "loss", "grad norm", "clip", "mean |dparam| TRL adv", "mean |dparam|", "max |dparam|", "where"]
    rows = []
    for i, (o, t) in enumerate(zip(own, ours, strict=True)):
        cells = [o["loss"], o["grad_norm"], o["clip_frac"], t["mean_dparam"], o["mean_dparam"], o["max_dparam"]]
        formatted = (f"{c:.3g}" if j < 3 else f"{c:.1e}" for j, c in enumerate(cells))
        rows.append([i + 1, *formatted, o["worst"].removeprefix("model.")])
    print(table(header, rows))


# --- free runs ----------------------------------------------------------------------------------------------------


def run_trl_free(model_dir: Path, seed: int, prompts: int, steps: int, work: Path) -> list[dict]:
    """TRL's logs, one per generation batch (its means over the batch's two updates)."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    logs: list[dict] = []
    norms: list[float] = []

    class NormKeeping(GRPOTrainer):
        def _get_grad_norm(self, model, grad_norm=None):
            norm = super()._get_grad_norm(model, grad_norm=grad_norm)
            norms.append(float(norm))
            return norm

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:  # grad_norm_mean: as hpcrl's grad_norm, the mean of the batch's updates
                kept.append({"step": state.global_step // 2, **logs, "grad_norm_mean": sum(norms[-2:]) / 2})

    kept = logs
    trainer = make_trainer(
        NormKeeping, model_dir, seed, trl_config(work / f"trl-{seed}", seed, prompts, steps), [Keep()]
    )
    trainer.train()
    return logs


def run_hpcrl_free(model_dir: Path, seed: int, prompts: int, steps: int, work: Path) -> list[dict]:
    from _jobs import run_job
    from trl_grpo import hpcrl_overrides

    job = run_job(hpcrl_overrides(model_dir, seed, steps, prompts), work, f"hpcrl-{seed}", timeout_s=1800)
    return job.metrics


# (hpcrl key, TRL key) per column; None where that side logs no such metric
FREE_COLUMNS = {
    "reward": ("reward_mean", "reward"),
    "zero-std": ("reward_zero_std_frac", "frac_reward_zero_std"),
    "grad norm": ("grad_norm", "grad_norm_mean"),
    "lr": ("lr", "learning_rate"),
    "clip": ("clip_frac", "clip_ratio/region_mean"),
    "len": ("completion_len_mean", "completions/mean_length"),
    "gap": ("mismatch_abs_max", None),
}


def first_step(rows: list[dict], key: str, threshold: float) -> int | str:
    return next((int(r["step"]) for r in rows if r.get(key, -math.inf) >= threshold), "-")


def free_table(hpcrl: list[dict], trl: list[dict], every: int = 5) -> str:
    by_step = {"hpcrl": {int(m["step"]): m for m in hpcrl}, "trl": {int(m["step"]): m for m in trl}}
    last = max([*by_step["hpcrl"], *by_step["trl"], 0])
    header = ["step"] + [f"{col} {side}" for col in FREE_COLUMNS for side in ("hpcrl", "TRL")]
    rows = []
    for step in [1, *range(every, last + 1, every)]:
        row: list = [step]
        for keys in FREE_COLUMNS.values():
            for side, key in zip(("hpcrl", "trl"), keys, strict=True):
                value = by_step[side].get(step, {}).get(key) if key else None
                row.append("-" if value is None else float(value))
        rows.append(row)
    return table(header, rows)


def free(args) -> None:
    from hpcrl.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-trl-free-") as tmp:
        work = Path(tmp)
        for seed in args.seeds:
            model_dir = make_tiny_model(work / f"model-{seed}", seed=seed, characters=ALPHABET, **TINY)
            hpcrl = run_hpcrl_free(model_dir, seed, args.prompts, args.steps, work)
            trl = run_trl_free(model_dir, seed, args.prompts, args.steps, work)
            print(f"seed {seed}: {args.prompts} prompts x {GROUP}, {args.steps} steps (generation batches) each")
            print(f"hpcrl metrics.jsonl keys: {sorted({k for m in hpcrl for k in m})}")
            print(f"TRL log keys: {sorted({k for m in trl for k in m})}")
            print(free_table(hpcrl, trl))
            for threshold in THRESHOLDS:
                h, t = first_step(hpcrl, "reward_mean", threshold), first_step(trl, "reward", threshold)
                print(f"first step with mean reward >= {threshold}: hpcrl {h}, TRL {t}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="replay: the seed of the model, data and TRL")
    parser.add_argument("--updates", type=int, default=6, help="replay: optimizer updates (even)")
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per generation batch (x 8)")
    parser.add_argument("--free", action="store_true", help="free runs of both instead of the replay")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="free: seeds")
    parser.add_argument("--steps", type=int, default=40, help="free: generation batches each run")
    args = parser.parse_args()
    if args.prompts < 1:
        sys.exit(f"--prompts must be >= 1, got {args.prompts}")
    free(args) if args.free else replay(args)


if __name__ == "__main__":
    main()
