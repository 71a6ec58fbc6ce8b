"""Where each setting applies: the one table of the settings that only some modes use, and what a run says of
those set where they do nothing.

    RULES    settings -> the mode they apply in (``When``: the setting that decides, and at which values)
    ALWAYS   every other field of the schema, by section: used in every mode
    unused(cfg)              the settings set away from their schema default where they do not apply
    refuse_given(keys, cfg)  ConfigError for a key given on the command line where it does not apply
    notes(cfg)               settings that apply, but not as written (model.dtype on CPU trainers)
    warn(cfg)                the run's console lines: one naming every unused setting and why, then each note

The rule, one for every field (README.md, "No setting is silently ignored"):
- a key given on the command line where it does not apply is refused (exit 2, one line naming what makes it
  apply): it was typed for this run, and doing nothing with it is surely not what was meant;
- a value a file sets (a group option, an experiment, a site's files) away from the schema's default where it does
  not apply is named in one warning line on the console: such files are shared across modes, so a value they carry
  for another mode is no mistake of this run, but the run says it does not use it;
- values that would train on other data or another model than the files say stay refused wherever they come from
  (``checks.check_dataset``: files with the synthetic task; ``check_critic``: a critic's start without a critic).

A field of a section several rules name applies only where every rule holds (``dataset.holdout``). The table is
read from the code that uses each field (grep it); tests/config/test_applies.py walks every field of the schema
through every workflow, algorithm preset, server backend and weight sync, so a new field must be classified here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config, RoleResources

log = logging.getLogger(__name__)


LAUNCHER = "hydra/launcher"  # no field: the Hydra launcher option the run was started with (None: not known)


@dataclass(frozen=True)
class When:
    """The mode settings apply in: while the settings ``keys`` pass ``holds`` (given their values in order)."""

    keys: tuple[str, ...]  # the settings that decide, e.g. ("workflow.name",); LAUNCHER for the launcher option
    says: str  # the condition as messages write it, e.g. "workflow.name=multi_turn"
    holds: Callable[..., bool]


def equals(key: str, *values: str) -> When:
    return When((key,), f"{key}={'|'.join(values)}", lambda v: v in values)


def positive(key: str) -> When:
    return When((key,), f"{key} > 0", lambda v: v > 0)


def _plugin(name: str) -> bool:
    return ":" in name  # checks.check_workflow: a built-in name, or module:function (a plug-in)


@dataclass(frozen=True)
class Rule:
    """``keys`` (a key names its field and everything below it; ``*`` stands for one part, e.g. a role) apply only
    where ``when`` holds. ``hint`` is the option that makes them apply, as the refusal names it."""

    keys: tuple[str, ...]
    when: When
    hint: str = ""  # "" = the condition itself
    from_files: bool = True  # False: only a key given on the command line is reported, a value from a file never

    def option(self) -> str:
        return self.hint or self.when.says


_SLURM = equals("cluster.kind", "slurm")
# the controller's own Slurm job (config/launcher.py) reads these too, and its own settings (cluster.controller)
_SUBMITIT = "hydra/launcher=submitit_slurm"
_SLURM_OR_SUBMITIT = When(
    ("cluster.kind", LAUNCHER),
    f"cluster.kind=slurm or {_SUBMITIT}",
    lambda kind, launcher: kind == "slurm" or launcher in (None, "submitit_slurm"),
)
_CONTROLLER_JOB = When((LAUNCHER,), _SUBMITIT, lambda launcher: launcher in (None, "submitit_slurm"))
_SLURM_HINT = "cluster=slurm (or a site's cluster file)"
_CRITIC = positive("allocation.critic.workers")
_REWARD_MODEL = positive("allocation.reward_model.workers")
_REWARD_MODEL_HINT = "allocation.reward_model.workers=N (or +rm:cpu:d1 in allocation.spec)"
_JUDGE = When(("reward.fn",), "reward.fn with llm_judge", lambda v: "llm_judge" in str(v))
_FILES = equals("dataset.name", "files")
_FILES_HINT = "dataset=files (or dataset=gsm8k, experiment=gsm8k)"
_MOD10 = equals("dataset.name", "mod10")
_PLUGIN = When(("workflow.name",), "workflow.name=module:function (a plug-in)", _plugin)
_MULTI_TURN_OR_PLUGIN = When(
    ("workflow.name",), "workflow.name=multi_turn|module:function", lambda v: v == "multi_turn" or _plugin(v)
)
_NO_SPEC = When(("allocation.spec",), 'allocation.spec=""', lambda v: not v)


def _servers_on(backend: str) -> When:
    """The policy's servers, or the reward model's where it has some, run on ``backend``."""
    return When(
        ("allocation.server.backend", "allocation.reward_model.workers", "allocation.reward_model.backend"),
        f"allocation.server.backend={backend} or allocation.reward_model.backend={backend} with reward-model workers",
        lambda server, rm_workers, rm_backend: server == backend or (rm_workers > 0 and rm_backend == backend),
    )


# the CPU server batches generation only: a generative reward model (a judge) on it generates, while a
# discriminative one's /classify scores each request on its own (inference/server/__main__.py serve_reward_model)
_GENERATING_ON_CPU = When(
    (
        "allocation.server.backend",
        "allocation.reward_model.workers",
        "allocation.reward_model.backend",
        "reward.model.kind",
    ),
    "allocation.server.backend=cpu or a generative reward model's workers on allocation.reward_model.backend=cpu",
    lambda server, rm_workers, rm_backend, kind: (
        server == "cpu" or (rm_workers > 0 and rm_backend == "cpu" and kind == "generative")
    ),
)


def _keys(section: str, names: str) -> tuple[str, ...]:
    return tuple(f"{section}.{name}" for name in names.split())


RULES: tuple[Rule, ...] = (
    # rollout/workflows: make_workflow reads each only for the workflows named
    Rule(_keys("workflow", "max_turns feedback"), equals("workflow.name", "multi_turn")),
    Rule(("workflow.turn_discount",), _MULTI_TURN_OR_PLUGIN),
    Rule(_keys("workflow", "n train_on"), equals("workflow.name", "best_of_n", "majority_vote")),
    Rule(("workflow.verifier",), equals("workflow.name", "best_of_n")),
    Rule(("workflow.stages",), equals("workflow.name", "pipeline")),
    Rule(_keys("workflow", "chat_template tool_parser"), _PLUGIN),
    # controller/batch.py: GAE from the critic's values; the group and batch estimators divide by std + std_eps
    Rule(_keys("algorithm", "gamma lam value_clip"), equals("algorithm.advantage", "gae"), "algorithm=ppo"),
    Rule(("algorithm.std_eps",), equals("algorithm.advantage", "group_norm", "batch_norm")),
    Rule(_keys("algorithm.kl", "place estimator"), positive("algorithm.kl.coef")),  # no KL term at 0
    Rule(("algorithm.off_policy.cap",), equals("algorithm.off_policy.kind", "tis")),
    Rule(
        _keys("algorithm.off_policy", "low high"),
        equals("algorithm.off_policy.kind", "mis_token", "mis_sequence", "icepop"),
    ),
    Rule(
        ("algorithm.shuffle_minibatches",),
        When(("algorithm.updates_per_batch",), "algorithm.updates_per_batch > 1", lambda v: v > 1),
    ),
    Rule(("model.path",), equals("model.source", "local"), "model=local"),
    Rule(("model.tiny",), equals("model.source", "tiny"), "model=tiny"),
    Rule(("model.critic_path", "train.critic_lr"), _CRITIC, "algorithm=ppo"),
    Rule(_keys("dataset", "train_files eval_files holdout"), _FILES, _FILES_HINT),
    Rule(_keys("dataset", "prompt_column answer_column prompt_template"), _FILES, "dataset=files"),
    Rule(
        ("dataset.holdout",),
        When(("dataset.eval_files",), "dataset.eval_files=[]", lambda v: not v),
        "no dataset.eval_files",
    ),
    Rule(("dataset.train_size",), _MOD10, "dataset=mod10"),
    Rule(("dataset.eval_size",), _MOD10, "dataset=mod10 (files: dataset.holdout)"),
    Rule(("train.weight_sync_bucket_mb",), equals("train.weight_sync", "distributed")),
    # controller/adapter_sync.py: an adapter goes whole in one body, not in buckets over the group
    Rule(("train.weight_sync_bucket_mb",), When(("train.lora.rank",), "train.lora.rank=0", lambda v: v == 0)),
    Rule(_keys("train.lora", "alpha dropout target_modules"), positive("train.lora.rank")),  # no adapter at 0
    Rule(("export.merged",), positive("train.lora.rank")),  # a full fine-tune's export is the whole model
    # inference/commands.py: the cpu server takes neither; SGLang has no batch wait of its own. The reward model's
    # servers (inference/worker.py) take the same inference settings on their own backend.
    Rule(_keys("inference", "mem_fraction_static extra_args"), _servers_on("sglang")),
    Rule(("inference.batch_wait_ms",), _GENERATING_ON_CPU),
    Rule(("inference.max_restarts",), equals("inference.on_server_exit", "restart")),
    Rule(("checkpoint.keep",), positive("checkpoint.every_steps"), "checkpoint.every_steps=N"),
    Rule(
        ("metrics.wandb",),
        When(("metrics.loggers",), "metrics.loggers with wandb", lambda v: "wandb" in v),
        "logger=wandb (or metrics.loggers=[tensorboard,wandb])",
    ),
    Rule(("metrics.samples_per_log",), positive("metrics.samples_every_steps")),
    Rule(("reward.weights",), When(("reward.fn",), "reward.fn a list", lambda v: isinstance(v, list))),
    # launch/local.py reads none of these: only Slurm jobs do (the workers', and the controller's own)
    Rule(
        _keys("cluster", "partition account qos time_min constraint extra_sbatch setup"),
        _SLURM_OR_SUBMITIT,
        _SLURM_HINT,
    ),
    Rule(_keys("cluster", "submit_mode queue_timeout_min cpus_per_node"), _SLURM, _SLURM_HINT),
    Rule(
        _keys("cluster.roles.*", "cpus_per_worker mem_gb partition account qos constraint time_min"),
        _SLURM,
        _SLURM_HINT,
    ),
    Rule(_keys("cluster.roles.*", "extra_sbatch setup"), _SLURM, _SLURM_HINT),
    # a site's cluster file sizes its controller job for when it is submitted: only a key given is reported
    Rule(("cluster.controller",), _CONTROLLER_JOB, f"-m {_SUBMITIT}", from_files=False),
    Rule(_keys("allocation.critic", "backend gpus_per_worker tp_size nodes"), _CRITIC, "algorithm=ppo"),
    # controller/roles.py: the reward model's servers, and what they serve, only with workers (checks: path and
    # workers go together)
    Rule(_keys("allocation.reward_model", "backend gpus_per_worker tp_size nodes"), _REWARD_MODEL, _REWARD_MODEL_HINT),
    Rule(("reward.model.kind",), _REWARD_MODEL, _REWARD_MODEL_HINT),
    # reward/: the builtin llm_judge reads them
    Rule(("reward.judge",), _JUDGE, "reward.fn=hpcrl.reward.judge:llm_judge"),
    # evaluation only (run.max_steps=0, controller/eval_only.py) starts the servers and the reward, trains nothing
    Rule(
        (
            *("train", "algorithm", "allocation.trainer", "allocation.critic", "checkpoint", "export", "recover"),
            *("metrics", "eval.every_steps", "eval.stop_at_accuracy", "model.critic_path", "cluster.hang_timeout_s"),
            *_keys("rollout", "prompts_per_step temperature max_staleness max_rejected_in_a_row workers"),
        ),
        positive("run.max_steps"),
        "run.max_steps >= 1 (training)",
        from_files=False,
    ),
    # the shorthand replaces the roles (allocation.resolve_allocation): an allocation file's roles are what it replaces
    Rule(_keys("allocation", "server trainer critic reward_model"), _NO_SPEC, "no allocation.spec", from_files=False),
)

# Every other field, by section: used in every mode (a note where that is not plain from the schema's comment)
ALWAYS: dict[str, tuple[str, ...]] = {
    "run": ("root", "experiment", "trial", "seed", "max_steps", "log_level", "dry_run"),
    "allocation": ("spec",),
    "allocation.server": ("backend", "workers", "gpus_per_worker", "tp_size", "nodes", "min_workers"),  # cpu: tp
    # tp_size: 1 only, min_workers: null only (checks.check_elastic_fleet)
    "allocation.trainer": ("backend", "workers", "gpus_per_worker", "tp_size", "nodes", "min_workers"),
    "allocation.critic": ("workers", "min_workers"),
    "allocation.reward_model": ("workers", "min_workers"),  # min_workers: null only (allocation._resolve_reward_model)
    "cluster": ("name", "kind", "gpus_per_node", "worker_lease_s", "hang_timeout_s", "env"),
    # the controller's job, when it is one (RULES: a key given without its launcher is refused)
    "cluster.controller": (
        *("partition", "account", "qos", "constraint", "extra_sbatch", "time_min", "cpus", "mem_gb"),
        *("signal_delay_s", "max_requeues"),
    ),
    "cluster.roles.*": ("setup_timeout_s", "env"),  # the local scheduler's too (a role that does not run: unread)
    "cluster.net": ("family", "interface", "advertise_host", "bind_host", "port_min", "port_max"),
    "algorithm": (
        *("name", "advantage", "loss_agg", "group_size", "clip_low", "clip_high"),
        *("kl_coef", "kl_estimator", "drop_equal_reward_groups", "behavior_weight_cap", "updates_per_batch"),
        "behaviour_logprobs",
    ),  # kl_coef, kl_estimator: renamed, refused when set (checks.check_kl)
    "algorithm.kl": ("coef",),
    "algorithm.off_policy": ("kind",),
    "model": ("source", "dtype"),  # dtype: the trainers may compute in float32 (notes)
    "dataset": ("name", "chat_template"),
    "train": ("lr", "weight_decay", "grad_clip", "warmup_steps", "lr_schedule", "micro_batch_tokens", "weight_sync"),
    "train.lora": ("rank",),
    "rollout": (
        *("prompts_per_step", "max_new_tokens", "temperature", "top_p", "top_k", "max_concurrent", "max_staleness"),
        *("max_rejected_in_a_row", "max_empty_aborts", "request_timeout_s", "stop", "workers"),
    ),
    "workflow": ("name",),
    "inference": (
        *("max_running_requests", "health_poll_s", "weight_update_timeout_s", "context_overflow", "on_server_exit"),
    ),
    "reward": ("fn", "timeout_s", "on_error", "workers"),  # workers: an @in_process function's pool says it uses none
    "reward.model": ("path",),  # set with 0 workers: refused (checks.check_reward_model)
    "eval": ("every_steps", "stop_at_accuracy", "reward_fn"),  # reward_fn: plug-ins refused (checks)
    "checkpoint": ("every_steps",),
    "export": ("every_steps",),
    "metrics": ("loggers", "samples_every_steps"),
    "recover": ("mode",),
}


def always(key: str) -> bool:
    """Whether ``ALWAYS`` lists the field ``key`` (a role's field under ``cluster.roles.*``)."""
    section, _, name = key.rpartition(".")
    return any(fnmatchcase(section, s) and name in names for s, names in ALWAYS.items())


@functools.cache
def rules_for(key: str, from_files: bool = False) -> tuple[Rule, ...]:
    """The rules whose keys name ``key`` or a section above it (only those that report files' values: from_files)."""
    return tuple(r for r in RULES if (r.from_files or not from_files) and any(_at_or_below(key, k) for k in r.keys))


def _at_or_below(key: str, pattern: str) -> bool:
    parts, head = key.split("."), pattern.split(".")
    return len(parts) >= len(head) and all(fnmatchcase(p, h) for p, h in zip(parts, head, strict=False))


def value_at(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def _values(when: When, cfg: Config, launcher: str | None) -> list[Any]:
    return [launcher if key == LAUNCHER else value_at(cfg, key) for key in when.keys]


def failed_rule(key: str, cfg: Config, launcher: str | None = None, from_files: bool = False) -> Rule | None:
    """The first rule of ``key`` that does not hold in ``cfg`` started with ``launcher``; None where it applies."""
    return next((r for r in rules_for(key, from_files) if not r.when.holds(*_values(r.when, cfg, launcher))), None)


@dataclass(frozen=True)
class Unused:
    key: str  # the setting
    rule: Rule  # the first of its rules that does not hold
    now: str  # what the deciding settings are in this run, e.g. "workflow.name is single_turn"


def unused(cfg: Config, launcher: str | None = None, defaults: Config | None = None) -> list[Unused]:
    """Each setting of ``cfg`` away from its default (``defaults``: the schema's) whose rules do not all hold when
    started with ``launcher`` (None: not known; the rules it decides hold)."""
    found = []
    for key, value, default in leaves(cfg, Config() if defaults is None else defaults):
        if value != default and (rule := failed_rule(key, cfg, launcher, from_files=True)) is not None:
            found.append(Unused(key, rule, _now(rule.when, cfg, launcher)))
    return found


def _now(when: When, cfg: Config, launcher: str | None) -> str:
    return ", ".join(f"{k} is {_text(v)}" for k, v in zip(when.keys, _values(when, cfg, launcher), strict=True))


def leaves(node: Any, default: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(key, value, default) of every field below ``node``: dataclass fields, and the fields of a dict's
    dataclass values (``cluster.roles.<role>``, each role's default being the schema's, or RoleResources())."""
    for f in dataclasses.fields(node):
        key, value, was = f"{prefix}{f.name}", getattr(node, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, was, key + ".")
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for name, item in value.items():
                yield from leaves(item, was.get(name) or RoleResources(), f"{key}.{name}.")
        else:
            yield key, value, was


def refuse_given(keys: dict[str, Any], cfg: Config, launcher: str | None = None) -> None:
    """ConfigError for the first key of ``keys`` (given on the command line, with its value as given) whose rules
    do not all hold in ``cfg`` started with ``launcher``, naming the option that makes it apply."""
    for key, value in keys.items():
        if (rule := failed_rule(key, cfg, launcher)) is not None:
            now = _now(rule.when, cfg, launcher)
            raise ConfigError(key, value, f"{rule.option()} beside it: {key} counts only with {rule.when.says} ({now})")


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value) if value == "" else str(value)


def unused_line(found: Sequence[Unused]) -> str:
    """One line naming each unused setting, grouped by the condition it lacks, e.g. ``workflow.n (only with
    workflow.name=best_of_n|majority_vote; workflow.name is single_turn)``; "" for none."""
    groups: dict[tuple[str, str], list[str]] = {}
    for u in found:
        groups.setdefault((u.rule.when.says, u.now), []).append(u.key)
    parts = [f"{', '.join(keys)} (only with {cond}; {now})" for (cond, now), keys in groups.items()]
    return f"these settings have no effect in this run: {'; '.join(parts)}" if parts else ""


def notes(cfg: Config) -> list[str]:
    """Settings that apply, but not as written: one line each, saying what the run does instead."""
    out: list[str] = []
    if cfg.run.max_steps == 0:  # evaluation only: no trainer, no checkpoint
        return out
    dtype = cfg.model.dtype
    if dtype == "float16":  # train/engine.py's mixed precision: bfloat16 on a CUDA device that has it, else float32
        why = "float16 training needs loss scaling, which hpcrl's trainer does not do"
        out.append(f"model.dtype=float16: the trainers compute in float32 ({why}); the servers generate in float16")
    if dtype == "bfloat16" and cfg.allocation.trainer.gpus_per_worker == 0:
        how = "run on CPUs (allocation.trainer.gpus_per_worker=0) and compute in float32 (bfloat16 needs a CUDA GPU)"
        out.append(f"model.dtype=bfloat16: the trainers {how}; the servers generate in bfloat16")
    if cfg.train.lora.rank and cfg.train.weight_sync == "distributed":
        how = "in the body of /load_lora_adapter_from_tensors (SGLang has no collective path for adapters)"
        out.append(f"train.weight_sync=distributed with train.lora: the adapter goes to the servers {how}")
    if cfg.recover.mode == "auto" and cfg.checkpoint.every_steps == 0:
        out.append("recover.mode=auto with checkpoint.every_steps=0: this run writes no checkpoint to resume from")
    return out


def warn(cfg: Config, launcher: str | None = None) -> None:
    """Say, once per run on the console (after logging is set up), what ``cfg`` started with ``launcher`` sets that
    does nothing here, and what applies other than as written."""
    line = unused_line(unused(cfg, launcher))
    for message in ([line] if line else []) + notes(cfg):
        log.warning("%s", message)
