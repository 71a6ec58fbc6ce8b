"""What the TRL benchmarks share: the task's model sizes and batch, and the ``GRPOConfig`` that gives TRL's
``GRPOTrainer`` the default job's settings (``bench/trl_grpo.py``, ``bench/trl_steps.py``).

TRL is imported only inside ``trl_config`` and ``make_trainer``: the constants serve scripts and tests that run
without it.
"""

from __future__ import annotations

from pathlib import Path

ALPHABET = "+0123456789="
TINY = dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512)  # conf/model/tiny.yaml
PROMPTS, GROUP, LR = 64, 8, 5e-4


def trl_config(output_dir: str | Path, seed: int, prompts: int, max_steps: int, **overrides):
    """TRL's ``GRPOConfig`` with the default job's settings: ``prompts`` x ``GROUP`` completions a generation batch
    split in 2 optimizer updates, at most 2 new tokens at temperature 1, AdamW lr ``LR`` constant, no decay, grad
    clip 1.0, clip 0.2, no KL, group mean/std advantages, per-sequence token-mean loss; CPU, float32, no vLLM.
    ``max_steps`` counts generation batches (TRL's ``max_steps`` counts optimizer updates, twice as many).
    ``overrides`` replace or add ``GRPOConfig`` fields; an unknown one is TRL's own TypeError."""
    from trl import GRPOConfig

    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=prompts * GROUP // 2,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_generations=GROUP,
        max_completion_length=2,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=False,
        logging_steps=2,
        max_steps=2 * max_steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
    )
    return GRPOConfig(**{**values, **overrides})


def mod10_reward(prompts, completions, answer, **_):
    """``hpcrl.reward.builtin:mod10`` as a TRL reward function."""
    from hpcrl.reward.builtin import mod10

    return [mod10(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]


def make_trainer(trainer_class, model_dir: str | Path, seed: int, config, callbacks: list):
    """``trainer_class`` (TRL's ``GRPOTrainer`` or a subclass of it) on the mod10 task's training rows of ``seed``
    (``make_mod10(2000, 200, seed)``, the bench's hpcrl job's) with the model at ``model_dir``, the mod10 reward,
    ``config`` (``trl_config``) and ``callbacks``; torch seeded with ``seed``. Without TRL's printer callback, which
    prints every log line to stdout."""
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback

    from hpcrl.data.mod10 import make_mod10
    from hpcrl.models.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    train, _ = make_mod10(2000, 200, seed)
    trainer = trainer_class(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=mod10_reward,
        args=config,
        train_dataset=train,
        processing_class=load_tokenizer(model_dir),
        callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)
    return trainer
