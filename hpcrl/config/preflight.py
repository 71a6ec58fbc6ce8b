"""What a config names outside itself, checked where a run is launched, before anything starts or is submitted.

    model.path          a directory with config.json, tokenizer files and weights (model.source=local)
    dataset files       dataset.train_files and dataset.eval_files exist, as .jsonl, .json or .parquet files
    metrics.loggers     wandb is installed when it is named
    workflow            a plug-in's .jinja chat template exists
    reward.fn           every function imports, as each reward process imports it (workflow.verifier too)
    reward model        a model reward (one naming ``reward_model``) has reward-model servers to ask
                        (allocation.reward_model.workers, reward.model.path a model directory) of the kind it asks
                        (llm_judge a generative judge, reward_model_score a discriminative one); llm_judge's
                        template (or template_file) reads and names only columns the data has, its pattern compiles
    dataset columns     every file has the columns the config and the reward functions name (read cheaply:
                        ``hpcrl.data.files.peek``), and dataset.holdout leaves a batch of training rows
    max_new_tokens      fits the model's context with a prompt of one token (its config.json, or the size the
                        tiny model is made with), unless inference.context_overflow=truncate shortens it
    tiny-task settings  a warning naming each of the default job's settings left in force with a local model

Each check raises what the run itself would meet seconds later, from the same function (``RewardFns.resolve``,
``check_columns``, ``holdout_problem``, the client's ``context.fit``), so the dry run, the doctor and the run
fail with one line, the same one, before anything starts.

``checks.validate`` is not the place: every worker validates the run's config.yaml on its own node, where
the controller's relative paths may not resolve and the data files are never read. ``hpcrl.main`` (the dry
run too, and the submitting process of ``-m``), ``hpcrl.sbatch`` and ``hpcrl.doctor`` call ``preflight``.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config
from hpcrl.reward.registry import Reward, RewardFns, RewardSpecError, resolve_reward

log = logging.getLogger(__name__)
T = TypeVar("T")

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")  # any one
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

# The default job's settings, made for its tiny model and one-digit task, that a real model left with them
# trains badly: (key, the tiny task's value, why). tests/config/test_presets.py holds them equal to the default.
TINY_TASK_SETTINGS: tuple[tuple[str, object, str], ...] = (
    ("train.lr", 5e-4, "a 0.5B-7B model wants about 1e-6"),
    ("train.warmup_steps", 0, "a real model wants a few steps of warm-up"),
    ("rollout.max_new_tokens", 2, "one digit; a worked answer takes hundreds of tokens"),
    ("eval.stop_at_accuracy", 0.9, "the run stops at 0.9 held-out accuracy"),
    ("dataset.name", "mod10", "the synthetic a+b task"),
)


def preflight(cfg: Config) -> None:
    """Raise ConfigError for a missing model directory, dataset file or logger package (``warn_tiny_task_settings``
    is separate: it is called once logging is set up)."""
    if cfg.model.source == "local":
        check_model_path(cfg.model.path, evaluate_only=cfg.run.max_steps == 0)
    for key in ("train_files", "eval_files"):
        check_data_files(f"dataset.{key}", getattr(cfg.dataset, key))
    template = cfg.workflow.chat_template
    if template.endswith(".jinja") and not Path(template).expanduser().is_file():
        raise ConfigError("workflow.chat_template", template, f"a .jinja file: {Path(template).absolute()} is not one")
    if "wandb" in cfg.metrics.loggers and importlib.util.find_spec("wandb") is None:
        expected = "a list without wandb, or wandb installed: pip install 'hpcrl[wandb]'"
        raise ConfigError("metrics.loggers", cfg.metrics.loggers, expected)
    rewards = check_rewards(cfg)
    check_reward_model(cfg, rewards)
    check_data(cfg, row_rewards(cfg, rewards))
    check_context(cfg)
    check_lora_targets(cfg)


def check_lora_targets(cfg: Config) -> None:
    """With LoRA: every name of train.lora.target_modules is a module SGLang's --lora-target-modules takes
    (``lora_args`` raises naming them) and a Linear module of the model (read from its config on the meta device: no
    weights loaded; peft would skip a misspelt name beside good ones)."""
    from hpcrl.inference.sglang import lora_args

    lora = cfg.train.lora
    if not lora.rank or not cfg.run.max_steps:  # evaluation only trains no adapter
        return
    lora_args(lora.rank, lora.target_modules)
    from hpcrl.train.lora import lora_targets_problem

    if cfg.model.source == "local":
        model: object = evaluated_model_dir(cfg.model.path)
    else:
        from hpcrl.models.tiny import tiny_config

        model = tiny_config(cfg.model.tiny)
    problem = lora_targets_problem(model, list(lora.target_modules))
    if problem is not None:
        raise ConfigError("train.lora.target_modules", list(lora.target_modules), problem.split(": ", 1)[1])


def check_rewards(cfg: Config) -> RewardFns:
    """reward.fn (and best_of_n's workflow.verifier) imported here as every reward process imports it."""
    try:
        rewards = RewardFns.resolve(cfg.reward.fn, cfg.reward.weights)
    except RewardSpecError as e:
        raise ConfigError("reward.fn", cfg.reward.fn, f"functions every reward process can import: {e}") from e
    if cfg.eval.reward_fn and ":" in cfg.workflow.name:  # a plug-in workflow, module:function
        expected = f'"": a plug-in workflow ({cfg.workflow.name}) scores held-out episodes with its own final reward'
        raise ConfigError("eval.reward_fn", cfg.eval.reward_fn, expected)
    verifier = cfg.workflow.verifier
    if cfg.workflow.name == "best_of_n" and verifier:
        try:
            resolve_reward(verifier)
        except RewardSpecError as e:
            raise ConfigError("workflow.verifier", verifier, f"a function every reward process can import: {e}") from e
    return rewards


def row_rewards(cfg: Config, rewards: RewardFns) -> RewardFns:
    """``rewards`` (reward.fn's) with eval.reward_fn's and best-of-N's verifier's functions beside them (weight 0,
    never summed): every column one of them takes goes with each row, and a data file must have those they need."""
    others = _every_reward(cfg, rewards)[len(rewards.rewards) :]
    return RewardFns(rewards.rewards + tuple(others), rewards.weights + (0.0,) * len(others), rewards.listed)


def check_reward_model(cfg: Config, rewards: RewardFns) -> None:
    """A model reward of reward.fn (eval.reward_fn, workflow.verifier) has reward-model servers of its kind."""
    from hpcrl.reward.judge import KIND_OF

    model = cfg.reward.model
    asking = [r for r in _every_reward(cfg, rewards) if r.uses_reward_model]
    if not asking:
        return
    spec = asking[0].spec
    if not cfg.allocation.reward_model.workers:
        expected = (
            f"reward-model servers for {spec!r}, which asks the reward model: allocation.reward_model.workers >= 1 "
            "(and reward.model.path)"
        )
        raise ConfigError("allocation.reward_model.workers", cfg.allocation.reward_model.workers, expected)
    if not model.path:
        expected = f"the reward model's directory: {spec!r} asks the reward model, served from reward.model.path"
        raise ConfigError("reward.model.path", model.path, expected)
    check_model_dir(model.path, "reward.model.path")
    check_reward_model_kind(model.path, model.kind)
    for reward in asking:
        kind = KIND_OF.get(f"{reward.fn.__module__}:{reward.fn.__name__}")
        if kind is not None and kind != model.kind:
            route = "/generate" if kind == "generative" else "/classify"
            expected = f"{kind}: {reward.spec!r} asks a {kind} reward model (through {route})"
            raise ConfigError("reward.model.kind", model.kind, expected)


def check_reward_model_kind(path: str, kind: str) -> None:
    """reward.model.kind matches the model's architecture (config.json): a discriminative reward model is a
    sequence-classification model (served on /classify), a generative judge is not one (it answers on /generate)."""
    import json

    architectures = json.loads((Path(path).expanduser() / CONFIG_FILE).read_text()).get("architectures") or []
    scores = any(a.endswith("ForSequenceClassification") for a in architectures)
    if scores != (kind == "discriminative"):
        want = "discriminative" if scores else "generative"
        expected = f"{want}: reward.model.path's architectures are {architectures} ({Path(path) / CONFIG_FILE})"
        raise ConfigError("reward.model.kind", kind, expected)


def _every_reward(cfg: Config, rewards: RewardFns) -> list[Reward]:
    """reward.fn's functions, and eval.reward_fn's and best_of_n's verifier when they name one (resolved)."""
    found = list(rewards.rewards)
    others = {"eval.reward_fn": cfg.eval.reward_fn}
    if cfg.workflow.name == "best_of_n":
        others["workflow.verifier"] = cfg.workflow.verifier
    for key, spec in others.items():
        if spec:
            try:
                found.append(resolve_reward(spec))
            except RewardSpecError as e:
                raise ConfigError(key, spec, f"a function every reward process can import: {e}") from e
    return found


def judge_needs(cfg: Config, rewards: RewardFns) -> dict[str, str]:
    """The columns llm_judge's template names (each with the setting that names it), when reward.fn has llm_judge;
    ConfigError for a template file that cannot be read, a template str.format cannot read, a bad pattern."""
    from hpcrl.reward.judge import compiled_pattern, llm_judge, template_columns, template_text

    if not any(r.fn is llm_judge for r in _every_reward(cfg, rewards)):
        return {}
    judge = cfg.reward.judge
    key = "reward.judge.template_file" if judge.template_file else "reward.judge.template"
    try:
        text = template_text(judge.template, judge.template_file)
    except OSError as e:
        raise ConfigError(key, judge.template_file, f"a readable file holding llm_judge's template: {e}") from e
    try:
        columns = template_columns(text)
    except ValueError as e:
        raise ConfigError(key, text[:200], f"a str.format template of the row's columns: {e}") from e
    try:
        compiled_pattern(judge.pattern)
    except re.error as e:
        raise ConfigError("reward.judge.pattern", judge.pattern, f"a Python regular expression: {e}") from e
    return dict.fromkeys(columns, key)


def check_data(cfg: Config, rewards: RewardFns) -> tuple[int, int]:
    """Every data file has the columns the config and ``rewards`` name, and dataset.holdout leaves a batch of
    training rows: the errors ``hpcrl.data.load_splits`` would raise, from a cheap look at each file (``peek``).
    Returns how many rows train and how many are held out."""
    from hpcrl.data import MOD10, holdout_problem  # here: datasets takes a second to import
    from hpcrl.data.files import check_columns, peek, wanted_columns
    from hpcrl.data.mod10 import FEATURES

    d = cfg.dataset
    needs = {**rewards.needs(), **judge_needs(cfg, rewards)}
    if d.name == "mod10":
        _as_config_error("reward.fn", cfg.reward.fn, check_columns, MOD10, list(FEATURES), needs, "its rows hold")
        return d.train_size, d.eval_size
    wanted = wanted_columns(d.prompt_column, d.answer_column, d.prompt_template, needs)
    rows = {"train_files": 0, "eval_files": 0}
    for key in rows:
        for file in getattr(d, key):
            shape = _as_config_error(f"dataset.{key}", getattr(d, key), peek, file)
            _as_config_error(f"dataset.{key}", getattr(d, key), check_columns, file, shape.columns, wanted)
            rows[key] += shape.rows or 0
    if d.eval_files:
        return rows["train_files"], rows["eval_files"]
    batch = cfg.rollout.prompts_per_step if cfg.run.max_steps else 1  # evaluation only trains on no batch
    problem = holdout_problem(rows["train_files"], d.holdout, batch)
    if problem:
        raise ConfigError("dataset.holdout", d.holdout, problem)
    return rows["train_files"] - d.holdout, d.holdout


def data_line(cfg: Config) -> str:
    """The line a run logs as it loads its data (``hpcrl.data.split_line``: rows to train on, rows held out, from
    where), for a config ``preflight`` passed: what a dry run shows of the data."""
    from hpcrl.data import split_line

    return split_line(cfg.dataset, *check_data(cfg, check_rewards(cfg)))


def _as_config_error(key: str, value: object, check: Callable[..., T], *args: object) -> T:
    """``check(*args)``, its DataError as a ConfigError naming ``key`` (its text kept whole)."""
    from hpcrl.data.files import DataError

    try:
        return check(*args)
    except DataError as e:
        raise ConfigError(key, value, f"data that has what the config names: {e}") from e


def check_context(cfg: Config) -> None:
    """rollout.max_new_tokens fits the model's context with the shortest prompt, one token: else SGLang refuses every
    request (``context.fit``), which a run finds at its first evaluation. inference.context_overflow=truncate
    shortens max_new_tokens to what each prompt leaves, so it passes."""
    from hpcrl.inference.context import fit

    if cfg.inference.context_overflow != "drop":
        return
    context, where = model_context(cfg)
    new_tokens = cfg.rollout.max_new_tokens
    if fit(1, new_tokens, context):
        raise ConfigError(
            "rollout.max_new_tokens",
            new_tokens,
            f"at most {context - 1}: the model's context is {context} tokens ({where}), which must hold a request's "
            f"prompt (a token at least) and its max_new_tokens, or SGLang refuses the request (HTTP 400): with "
            f"{new_tokens} it refuses every one; or inference.context_overflow=truncate, which cuts max_new_tokens "
            "to what each prompt leaves",
        )


def model_context(cfg: Config) -> tuple[int, str]:
    """The context the servers will have, as the run's client reads it (``client_options``), and where it is from:
    model.path's config.json, or for the tiny model the size it is made with; SGLang's --context-length first."""
    from hpcrl.inference.sglang_args import launch_args, served_context
    from hpcrl.models.tiny import MAX_POSITIONS

    extra = cfg.inference.extra_args if cfg.allocation.server.backend == "sglang" else ()
    launch = launch_args(extra)
    given = "--context-length in inference.extra_args" if launch.context_length is not None else ""
    if cfg.model.source == "local":
        path = evaluated_model_dir(cfg.model.path)
        return served_context(path, extra), given or str(path / CONFIG_FILE)
    made = f"the tiny model is made with max_position_embeddings={MAX_POSITIONS}"
    return (launch.context_length or MAX_POSITIONS) - launch.reserved_tokens, given or made


def evaluated_model_dir(path: str) -> Path:
    """The directory whose config.json describes model.path's model: itself, or a checkpoint's run's model."""
    from hpcrl.train.checkpoint_model import checkpoint_base_model, is_checkpoint

    return checkpoint_base_model(path) if is_checkpoint(path) else Path(path).expanduser().absolute()


def check_model_path(path: str, evaluate_only: bool) -> None:
    """model.path: a model directory; for evaluation only (run.max_steps=0), a run's checkpoint too."""
    from hpcrl.train.checkpoint_model import checkpoint_problem, is_checkpoint

    if not is_checkpoint(path):
        check_model_dir(path)
        return
    if not evaluate_only:
        expected = (
            "a Hugging Face model directory, not a run's checkpoint: evaluate one with run.max_steps=0, or go on "
            "training its run with recover.mode=auto (and that run's run.experiment and run.trial)"
        )
        raise ConfigError("model.path", path, expected)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError("model.path", path, f"a complete checkpoint of a run: {problem}")


def check_model_dir(path: str, key: str = "model.path") -> None:
    """A Hugging Face model directory: config.json, a tokenizer, weights. ConfigError naming ``key`` and what is
    missing."""
    where = Path(path).expanduser()
    expected = "a Hugging Face model directory (config.json, tokenizer files, *.safetensors)"
    if not where.is_dir():
        why = "is not a directory" if where.exists() else "does not exist"
        raise ConfigError(key, path, f"{expected}: {where.absolute()} {why}{_hub_hint(path, where)}")
    missing = []
    if not (where / CONFIG_FILE).is_file():
        missing.append(CONFIG_FILE)
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if not any(next(where.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if missing:
        raise ConfigError(key, path, f"{expected}: {where.absolute()} has no {', no '.join(missing)}")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # what a Hugging Face Hub repository id looks like


def _hub_hint(path: str, where: Path) -> str:
    """For a ``model.path`` that is no directory here but reads as a Hub id: hpcrl loads only local directories."""
    if where.exists() or not HUB_ID.fullmatch(path):
        return ""
    return (
        f"; {path!r} looks like a Hugging Face Hub id, and hpcrl downloads nothing (cluster nodes often have no "
        f"internet): on a machine that has it, `hf download {path} --local-dir DIR`, then model.path=DIR on a "
        "filesystem the nodes share"
    )


def check_data_files(key: str, files: list[str]) -> None:
    for file in files:
        path = Path(file).expanduser()
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise ConfigError(key, files, f"local {', '.join(DATA_SUFFIXES)} files: {file} has another extension")
        if not path.is_file():
            why = "is not a file" if path.exists() else "does not exist"
            raise ConfigError(key, files, f"local data files: {file} {why} (resolved to {path.absolute()})")


def tiny_task_settings_in_force(cfg: Config) -> list[str]:
    """``key=value (why)`` for each of the default job's settings ``cfg`` keeps (of those that apply: evaluation
    only has no learning rate)."""
    from hpcrl.config.applies import failed_rule

    kept = []
    for key, value, why in TINY_TASK_SETTINGS:
        if failed_rule(key, cfg) is not None:
            continue
        node: object = cfg
        for part in key.split("."):
            node = getattr(node, part)
        if node == value:
            kept.append(f"{key}={value} ({why})")
    return kept


def warn_tiny_task_settings(cfg: Config) -> None:
    if cfg.model.source != "local":
        return
    kept = tiny_task_settings_in_force(cfg)
    if kept:
        log.warning(
            "model.source=local keeps the tiny task's %s: set them, or start from a preset for real models such "
            "as experiment=gsm8k (docs/quickstart.md shows both side by side)",
            "; ".join(kept),
        )
