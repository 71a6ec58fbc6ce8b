"""Range and cross-field checks of a composed Config, run before anything starts.

``validate`` returns the config with derived values filled in (the allocation shorthand applied,
GPUs per worker and node counts resolved) or raises ConfigError naming the first bad field.
"""

from __future__ import annotations

import math
import os.path
from dataclasses import replace

from hpcrl.config.allocation import ROLES, check_cpus_per_node, resolve_allocation
from hpcrl.config.errors import ConfigError, one_of, require
from hpcrl.config.schema import (
    AlgorithmConfig,
    AllocationConfig,
    ClusterConfig,
    Config,
    DatasetConfig,
    EvalConfig,
    InferenceConfig,
    LoRAConfig,
    MetricsConfig,
    ModelConfig,
    NetConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    WorkflowConfig,
)
from hpcrl.inference.openai.chat import TOOL_PARSERS
from hpcrl.inference.openai.templates import TEMPLATES
from hpcrl.inference.sglang_args import check_extra_args

OPTIONAL_ROLES = ("critic", "rollout", "reward_model")
REWARD_MODEL_KINDS = ("generative", "discriminative")


def validate(cfg: Config) -> Config:
    """Check every section; return the config with the allocation resolved."""
    check_run(cfg.run)
    check_cluster(cfg.cluster)
    allocation = resolve_allocation(cfg.allocation, cfg.cluster)
    check_algorithm(cfg.algorithm)
    check_critic(cfg, allocation)
    check_cpus_per_node(cfg.cluster, allocation)
    check_model(cfg.model)
    dataset = check_dataset(cfg.dataset)
    check_train(cfg.train)
    check_lora_critic(cfg)
    check_lora_servers(cfg.train.lora, allocation)
    check_schedule(cfg)
    check_minibatches(cfg)
    check_rollout(cfg.rollout)
    check_workflow(cfg.workflow)
    check_plugin_prompts(cfg.workflow, dataset)
    check_workflow_groups(cfg.workflow, cfg.algorithm.group_size)
    check_inference(cfg.inference)
    for backend in {
        allocation.server.backend,
        allocation.reward_model.backend if allocation.reward_model.workers else "",
    }:
        check_extra_args(cfg.inference.extra_args, backend)  # as SGLang parses them
    check_server_restart(cfg)
    check_elastic_fleet(cfg)
    check_weight_sync(cfg.train, allocation)
    check_reward(cfg.reward)
    check_reward_model(cfg, allocation)
    check_eval(cfg.eval)
    require(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", cfg.checkpoint.every_steps, "an integer >= 0")
    require(
        cfg.checkpoint.keep >= 0, "checkpoint.keep", cfg.checkpoint.keep, "an integer >= 0 (0 = keep every checkpoint)"
    )
    every = cfg.export.every_steps
    require(every >= 0, "export.every_steps", every, "an integer >= 0 (0 = the final model only)")
    check_metrics(cfg.metrics)
    check_recover(cfg)
    return replace(cfg, allocation=allocation, dataset=dataset)


def check_run(run: RunConfig) -> None:
    require(bool(run.root), "run.root", run.root, "a directory path")
    for name in ("experiment", "trial"):
        value = getattr(run, name)
        ok = bool(value) and os.path.sep not in value and value not in (".", "..")
        require(ok, f"run.{name}", value, "a non-empty name without '/'")
    steps = run.max_steps
    require(steps >= 0, "run.max_steps", steps, "an integer >= 0 (0 = evaluate model.path only, train nothing)")
    one_of("run.log_level", run.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))


def check_cluster(c: ClusterConfig) -> None:
    one_of("cluster.kind", c.kind, ("local", "slurm"))
    one_of("cluster.submit_mode", c.submit_mode, ("hetjob", "per_role", "steps"))
    require(c.queue_timeout_min >= 0, "cluster.queue_timeout_min", c.queue_timeout_min, "minutes >= 0 (0 = no limit)")
    lease = c.worker_lease_s
    require(lease >= 3, "cluster.worker_lease_s", lease, "seconds >= 3 (the controller renews every lease_s / 6)")
    require(c.hang_timeout_s > 0, "cluster.hang_timeout_s", c.hang_timeout_s, "seconds > 0")
    require(c.gpus_per_node >= 0, "cluster.gpus_per_node", c.gpus_per_node, "an integer >= 0")
    require(c.cpus_per_node >= 0, "cluster.cpus_per_node", c.cpus_per_node, "an integer >= 0 (0 = unchecked)")
    require(c.time_min >= 1, "cluster.time_min", c.time_min, "minutes >= 1")
    for role, res in c.roles.items():
        where = f"cluster.roles.{role}"
        one_of(f"{where} (role name)", role, (*ROLES, *OPTIONAL_ROLES))
        require(res.setup_timeout_s > 0, f"{where}.setup_timeout_s", res.setup_timeout_s, "seconds > 0")
        require(res.cpus_per_worker >= 1, f"{where}.cpus_per_worker", res.cpus_per_worker, "an integer >= 1")
        require(res.mem_gb >= 0, f"{where}.mem_gb", res.mem_gb, "GiB >= 0 (0 = scheduler default)")
        require(res.time_min >= 0, f"{where}.time_min", res.time_min, "minutes >= 0 (0 = cluster.time_min)")
    for role in ROLES:
        require(role in c.roles, f"cluster.roles.{role}", None, "resources for every role")
    require(c.controller.cpus >= 1, "cluster.controller.cpus", c.controller.cpus, "an integer >= 1")
    require(c.controller.mem_gb >= 0, "cluster.controller.mem_gb", c.controller.mem_gb, "GiB >= 0")
    require(c.controller.time_min >= 0, "cluster.controller.time_min", c.controller.time_min, "minutes >= 0")
    delay = c.controller.signal_delay_s
    require(delay >= 1, "cluster.controller.signal_delay_s", delay, "seconds >= 1 (the checkpoint's head start)")
    require(
        c.controller.max_requeues >= 0, "cluster.controller.max_requeues", c.controller.max_requeues, "an integer >= 0"
    )
    check_net(c.net)


def check_net(n: NetConfig) -> None:
    one_of("cluster.net.family", n.family, ("auto", "ipv4", "ipv6"))
    if n.port_min == 0 and n.port_max == 0:
        return
    require(1024 <= n.port_min < 65536, "cluster.net.port_min", n.port_min, "a port in 1024..65535")
    expected = f"a port > cluster.net.port_min={n.port_min} and <= 65536"
    require(n.port_min < n.port_max <= 65536, "cluster.net.port_max", n.port_max, expected)


# Where the KL term to the reference goes, and the one estimator whose expected gradient there is the gradient
# of KL(pi || ref) (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL",
# arXiv:2506.09477; tests/train/test_algorithms.py checks it by exact enumeration):
# - loss: d/dlogpi of k2 = log(pi/ref)^2 / 2 is log(pi/ref), so E_pi[grad k2] = E_pi[log(pi/ref) grad log pi], the
#   gradient of each token's KL(pi(.|prefix) || ref(.|prefix)) at the prefixes sampled
# - reward: -coef * k1 per token, summed from each token to the end (its return), so the policy gradient adds
#   coef * E[log(pi/ref) grad log pi] over the sequence: the gradient of the sequence's KL (PPO for RLHF)
KL_COMBINATIONS = {"loss": "k2", "reward": "k1"}
_KL_REFUSED = {
    ("loss", "k1"): "in the loss k1 = log(pi/ref) has an expected gradient of exactly 0 over samples of pi "
    "(E_pi[grad log pi] = 0): it regularises nothing",
    ("loss", "k3"): "in the loss k3 = ref/pi - log(ref/pi) - 1 has the expected gradient of KL(ref || pi), the "
    "other direction, not of KL(pi || ref) (Tang & Munos 2025, arXiv:2506.09477)",
    ("reward", "k2"): "as a reward penalty only k1 makes the policy gradient E[penalty * grad log pi] that of "
    "KL(pi || ref)",
    ("reward", "k3"): "as a reward penalty only k1 makes the policy gradient E[penalty * grad log pi] that of "
    "KL(pi || ref)",
}


def kl_combination_problem(place: str, estimator: str) -> str | None:
    """Why ``algorithm.kl.place`` and ``algorithm.kl.estimator`` together do not give the gradient of KL(pi || ref),
    and what to set instead; None when they do (or the place is unknown, which ``one_of`` reports)."""
    if place not in KL_COMBINATIONS or KL_COMBINATIONS[place] == estimator:
        return None
    why = _KL_REFUSED.get((place, estimator), f"{estimator!r} is no estimator")
    other = next(p for p in KL_COMBINATIONS if p != place)
    return (
        f"{KL_COMBINATIONS[place]} with algorithm.kl.place={place} ({why}), "
        f"or algorithm.kl.place={other} with {KL_COMBINATIONS[other]}"
    )


def check_kl(a: AlgorithmConfig) -> None:
    for old, new in (("kl_coef", "algorithm.kl.coef"), ("kl_estimator", "algorithm.kl.estimator")):
        value = getattr(a, old)
        require(value is None, f"algorithm.{old}", value, f"unset: it was renamed, set {new} instead")
    one_of("algorithm.kl.place", a.kl.place, tuple(KL_COMBINATIONS))
    one_of("algorithm.kl.estimator", a.kl.estimator, ("k1", "k2", "k3"))
    problem = kl_combination_problem(a.kl.place, a.kl.estimator)
    require(problem is None, "algorithm.kl.estimator", a.kl.estimator, str(problem))
    require(a.kl.coef >= 0, "algorithm.kl.coef", a.kl.coef, "a number >= 0 (0 = no KL term)")


def check_algorithm(a: AlgorithmConfig) -> None:
    one_of("algorithm.advantage", a.advantage, ("group_norm", "group_center", "batch_norm", "gae"))
    one_of("algorithm.loss_agg", a.loss_agg, ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"))
    check_kl(a)
    grouped = a.advantage in ("group_norm", "group_center")
    require(a.group_size >= (2 if grouped else 1), "algorithm.group_size", a.group_size, "an integer >= 2 for groups")
    require(0 <= a.clip_low < 1, "algorithm.clip_low", a.clip_low, "a number in [0, 1)")
    require(a.clip_high >= 0, "algorithm.clip_high", a.clip_high, "a number >= 0")
    cap = a.behavior_weight_cap
    require(cap == 0 or cap >= 1, "algorithm.behavior_weight_cap", cap, "0 (off) or a cap >= 1")
    check_off_policy(a)
    require(a.std_eps > 0, "algorithm.std_eps", a.std_eps, "a number > 0")
    require(a.updates_per_batch >= 1, "algorithm.updates_per_batch", a.updates_per_batch, "an integer >= 1")
    require(0 <= a.gamma <= 1, "algorithm.gamma", a.gamma, "a discount in [0, 1]")
    require(0 <= a.lam <= 1, "algorithm.lam", a.lam, "GAE's lambda in [0, 1]")
    require(a.value_clip >= 0, "algorithm.value_clip", a.value_clip, "a number >= 0 (0 = no value clipping)")


OFF_POLICY_KINDS = ("none", "tis", "mis_token", "mis_sequence", "icepop")


def check_off_policy(a: AlgorithmConfig) -> None:
    """The correction, its band or cap, and where the behaviour logprobs come from (off_policy.py says why)."""
    o = a.off_policy
    one_of("algorithm.off_policy.kind", o.kind, OFF_POLICY_KINDS)
    one_of("algorithm.behaviour_logprobs", a.behaviour_logprobs, ("server", "recompute"))
    require(o.cap > 0, "algorithm.off_policy.cap", o.cap, "a number > 0 (the largest importance weight)")
    # a band without ratio 1 would drop the tokens on which both policies agree
    require(0 <= o.low <= 1, "algorithm.off_policy.low", o.low, "a number in [0, 1]")
    require(o.high >= 1 and o.high > o.low, "algorithm.off_policy.high", o.high, "a number >= 1 and above low")
    if a.behaviour_logprobs == "recompute":
        # the trainer's logprobs then stand for the behaviour policy's: every ratio a correction or decoupled PPO
        # weighs would be exactly 1
        for key, value, off in (
            ("algorithm.off_policy.kind", o.kind, "none"),
            ("algorithm.behavior_weight_cap", a.behavior_weight_cap, 0),
        ):
            require(
                value == off,
                key,
                value,
                f"{off!r} with algorithm.behaviour_logprobs=recompute, which makes "
                "the behaviour logprobs the trainer's own: every importance ratio would be 1",
            )


def check_critic(cfg: Config, allocation: AllocationConfig) -> None:
    """A critic exactly when the advantages need one (GAE), and its start directory only with one."""
    workers, advantage = allocation.critic.workers, cfg.algorithm.advantage
    if advantage == "gae" and not workers:
        raise ConfigError(
            "allocation.critic.workers",
            workers,
            "an integer >= 1 with algorithm.advantage=gae: GAE needs a critic's values (e.g. "
            "allocation.critic.workers=1, or +critic:d1 in allocation.spec), or pick algorithm=reinforce_pp, "
            "which needs none",
        )
    if workers and advantage != "gae":
        raise ConfigError(
            "allocation.critic.workers",
            workers,
            f"0 with algorithm.advantage={advantage}, which uses no values (the critic would train for nothing); "
            "set algorithm.advantage=gae (algorithm=ppo) to use it",
        )
    if cfg.model.critic_path and not workers:
        expected = '"" without a critic (allocation.critic.workers=0)'
        raise ConfigError("model.critic_path", cfg.model.critic_path, expected)


def check_model(m: ModelConfig) -> None:
    one_of("model.source", m.source, ("tiny", "local"))
    require(m.source != "local" or bool(m.path), "model.path", m.path, "a local model directory for source=local")
    one_of("model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    t = m.tiny
    for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
        require(getattr(t, name) >= 1, f"model.tiny.{name}", getattr(t, name), "an integer >= 1")
    ok = t.hidden_size % t.num_heads == 0
    require(ok, "model.tiny.num_heads", t.num_heads, f"a divisor of hidden_size={t.hidden_size}")


CHAT_TEMPLATE = ("true", "false", "auto")


def check_dataset(d: DatasetConfig) -> DatasetConfig:
    """Check the dataset section; return it with ``chat_template`` as one of CHAT_TEMPLATE (YAML's false is "False")."""
    one_of("dataset.name", d.name, ("mod10", "files"))
    require(d.name != "files" or bool(d.train_files), "dataset.train_files", d.train_files, "files for name=files")
    for key in ("train_files", "eval_files"):
        files = getattr(d, key)
        expected = "no files with dataset.name=mod10, which makes its own rows: add dataset=files (or dataset=gsm8k)"
        require(d.name != "mod10" or not files, f"dataset.{key}", files, expected)
    one_of("dataset.chat_template", str(d.chat_template).lower(), CHAT_TEMPLATE)
    require(d.train_size >= 1, "dataset.train_size", d.train_size, "an integer >= 1")
    require(d.eval_size >= 1, "dataset.eval_size", d.eval_size, "an integer >= 1")
    require(d.holdout >= 1, "dataset.holdout", d.holdout, "an integer >= 1 (rows held out; or set dataset.eval_files)")
    return replace(d, chat_template=str(d.chat_template).lower())


def check_train(t: TrainConfig) -> None:
    require(t.lr > 0, "train.lr", t.lr, "a number > 0")
    require(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "a number >= 0")
    require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "a norm >= 0 (0 = no clipping)")
    require(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "an integer >= 0")
    one_of("train.lr_schedule", t.lr_schedule, ("constant", "cosine"))
    require(t.micro_batch_tokens >= 1, "train.micro_batch_tokens", t.micro_batch_tokens, "an integer >= 1")
    require(t.critic_lr > 0, "train.critic_lr", t.critic_lr, "a number > 0")
    one_of("train.weight_sync", t.weight_sync, ("disk", "distributed"))
    mb = t.weight_sync_bucket_mb
    require(mb >= 1, "train.weight_sync_bucket_mb", mb, "MiB >= 1 (one /update_weights_from_distributed call)")
    check_lora(t.lora)


def check_lora(lora: LoRAConfig) -> None:
    """The adapter's shape (whether its targets are modules of the model is checked with the model, before launch)."""
    require(lora.rank >= 0, "train.lora.rank", lora.rank, "an integer >= 0 (0 = no LoRA: full fine-tuning)")
    require(lora.alpha > 0, "train.lora.alpha", lora.alpha, "a number > 0 (the adapter's scale is alpha / rank)")
    require(0 <= lora.dropout < 1, "train.lora.dropout", lora.dropout, "a probability in [0, 1)")
    names = lora.target_modules
    ok = isinstance(names, list) and bool(names) and all(isinstance(n, str) and n for n in names)
    require(ok, "train.lora.target_modules", names, "a non-empty list of module names, e.g. [q_proj,v_proj]")


def check_lora_critic(cfg: Config) -> None:
    """LoRA trains the policy's adapters; the critic (advantage=gae) trains its full weights, so the two are not
    combined: refused rather than training the critic otherwise than the user may think."""
    if cfg.train.lora.rank and cfg.algorithm.advantage == "gae":
        expected = "0 with a critic (algorithm.advantage=gae, algorithm=ppo): LoRA trains the policy only"
        raise ConfigError("train.lora.rank", cfg.train.lora.rank, expected)


def check_lora_servers(lora: LoRAConfig, allocation: AllocationConfig) -> None:
    """hpcrl's CPU server applies adapters on one rank only (it refuses --enable-lora with --tp-size > 1)."""
    server = allocation.server
    if lora.rank and server.backend == "cpu" and server.tp_size > 1:
        expected = "1 with train.lora on the cpu server (it applies adapters on one rank; SGLang takes tp > 1)"
        raise ConfigError("allocation.server.tp_size", server.tp_size, expected)


def check_schedule(cfg: Config) -> None:
    """A cosine schedule decays after its warm-up, within the run (both in run steps)."""
    t, steps = cfg.train, cfg.run.max_steps
    if steps and t.lr_schedule == "cosine" and t.warmup_steps >= steps:  # 0 steps: no schedule runs
        expected = f"fewer than run.max_steps={steps} with train.lr_schedule=cosine (it decays after the warm-up)"
        raise ConfigError("train.warmup_steps", t.warmup_steps, expected)


def check_minibatches(cfg: Config) -> None:
    """Every step takes exactly ``algorithm.updates_per_batch`` updates, each on a minibatch of whole groups (of
    samples with ``algorithm.shuffle_minibatches``): the batch must hold at least that many."""
    a, groups = cfg.algorithm, cfg.rollout.prompts_per_step
    if a.shuffle_minibatches:
        parts, holds = groups * a.group_size, f"{groups * a.group_size} samples (rollout.prompts_per_step={groups} "
        holds += f"x algorithm.group_size={a.group_size}), and each update takes at least one"
    else:
        parts, holds = groups, f"{groups} groups (rollout.prompts_per_step), and each update takes whole groups"
    if a.updates_per_batch > parts:
        expected = f"at most {parts}: a step's batch holds {holds}"
        raise ConfigError("algorithm.updates_per_batch", a.updates_per_batch, expected)


def check_weight_sync(t: TrainConfig, allocation: AllocationConfig) -> None:
    """Trainers on GPUs send over nccl, which hpcrl's CPU server cannot receive."""
    on_gpu = bool(allocation.trainer.gpus_per_worker)
    if t.weight_sync == "distributed" and allocation.server.backend == "cpu" and on_gpu:
        raise ConfigError(
            "train.weight_sync",
            t.weight_sync,
            "disk with cpu servers and trainers on GPUs: the trainers send over nccl and the CPU server receives "
            "over gloo only (or put the trainers on CPUs: allocation.trainer.gpus_per_worker=0)",
        )


def check_rollout(r: RolloutConfig) -> None:
    require(r.prompts_per_step >= 1, "rollout.prompts_per_step", r.prompts_per_step, "an integer >= 1")
    require(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, "an integer >= 1")
    require(r.temperature > 0, "rollout.temperature", r.temperature, "a number > 0")
    # the servers sample from the truncated distribution but report the full one's logprobs, and the trainer
    # computes the full one's: every PPO ratio would be wrong (held-out evaluation is greedy, where neither matters)
    why = "(the servers would sample from the truncated distribution, the trainer's ratio is of the full one)"
    require(r.top_p == 1, "rollout.top_p", r.top_p, f"1.0 for training rollouts {why}")
    require(r.top_k == -1, "rollout.top_k", r.top_k, f"-1 (off) for training rollouts {why}")
    require(r.max_concurrent >= 1, "rollout.max_concurrent", r.max_concurrent, "an integer >= 1")
    require(r.max_staleness >= 0, "rollout.max_staleness", r.max_staleness, "an integer >= 0")
    n = r.max_rejected_in_a_row
    require(n >= 0, "rollout.max_rejected_in_a_row", n, "an integer >= 0 (0 = 4 * rollout.prompts_per_step)")
    require(r.max_empty_aborts >= 1, "rollout.max_empty_aborts", r.max_empty_aborts, "an integer >= 1")
    require(r.request_timeout_s > 0, "rollout.request_timeout_s", r.request_timeout_s, "seconds > 0")
    require(r.workers >= 0, "rollout.workers", r.workers, "an integer >= 0 (0 = episodes run in the controller)")


BUILTIN_WORKFLOWS = ("single_turn", "multi_turn", "best_of_n", "majority_vote", "pipeline")


def check_workflow(w: WorkflowConfig) -> None:
    if ":" in w.name:  # a plug-in: imported (and its errors named) when the job starts, before any worker
        module, _, attr = w.name.partition(":")
        ok = all(part.isidentifier() for part in [*module.split("."), attr])
        require(ok, "workflow.name", w.name, "a built-in workflow or 'package.module:function' (a plug-in)")
    else:
        one_of("workflow.name", w.name, BUILTIN_WORKFLOWS)
    ok = not w.chat_template or w.chat_template in TEMPLATES or w.chat_template.endswith(".jinja")
    require(ok, "workflow.chat_template", w.chat_template, f'"", one of {", ".join(TEMPLATES)}, or a .jinja file')
    one_of("workflow.tool_parser", w.tool_parser, TOOL_PARSERS)
    require(w.max_turns >= 1, "workflow.max_turns", w.max_turns, "an integer >= 1")
    require(0 < w.turn_discount <= 1, "workflow.turn_discount", w.turn_discount, "a number in (0, 1]")
    require(w.n >= 1, "workflow.n", w.n, "an integer >= 1")
    require(not w.verifier or ":" in w.verifier, "workflow.verifier", w.verifier, '"" or "module:function"')
    require(len(w.stages) >= 1, "workflow.stages", w.stages, "a list of at least one prompt template")
    one_of("workflow.train_on", w.train_on, ("all", "chosen"))


def check_plugin_prompts(w: WorkflowConfig, d: DatasetConfig) -> None:
    """A plug-in gets each row's prompt as written: the agent puts it in its own messages, which the episode's
    proxy renders with ``workflow.chat_template`` (docs/agents.md), so the dataset's template is not applied."""
    if ":" in w.name:
        require(
            d.chat_template != "true", "dataset.chat_template", d.chat_template,
            f"auto or false with a plug-in workflow ({w.name}): its proxy renders the agent's messages with "
            "workflow.chat_template, so the prompt is not templated first",
        )  # fmt: skip


def check_workflow_groups(w: WorkflowConfig, group_size: int) -> None:
    """A scaffold training on all its candidates needs a group size that is a multiple of workflow.n."""
    if w.name in ("best_of_n", "majority_vote") and w.train_on == "all" and group_size % w.n:
        raise ConfigError(
            "workflow.n",
            w.n,
            f"a divisor of algorithm.group_size={group_size}: workflow.train_on=all trains on every candidate "
            "of each run (or set workflow.train_on=chosen)",
        )


def check_inference(i: InferenceConfig) -> None:
    one_of("inference.on_server_exit", i.on_server_exit, ("drop", "restart", "fail"))
    require(i.max_restarts >= 0, "inference.max_restarts", i.max_restarts, "an integer >= 0")
    frac = i.mem_fraction_static
    require(0 < frac < 1, "inference.mem_fraction_static", frac, "a fraction in (0, 1)")
    n = i.max_running_requests
    require(n >= 1, "inference.max_running_requests", n, "an integer >= 1")
    require(i.batch_wait_ms >= 0, "inference.batch_wait_ms", i.batch_wait_ms, "milliseconds >= 0")
    require(i.health_poll_s > 0, "inference.health_poll_s", i.health_poll_s, "seconds > 0")
    timeout = i.weight_update_timeout_s
    require(timeout > 0, "inference.weight_update_timeout_s", timeout, "seconds > 0")
    one_of("inference.context_overflow", i.context_overflow, ("drop", "truncate"))


def check_server_restart(cfg: Config) -> None:
    """inference.on_server_exit=restart: a restarted server gets the weights from disk, and on Slurm the
    server role's job (or step) is started again on its own."""
    if cfg.inference.on_server_exit != "restart":
        return
    if cfg.train.weight_sync != "disk":
        raise ConfigError(
            "inference.on_server_exit",
            "restart",
            "drop or fail with train.weight_sync=distributed: a restarted server cannot join the weight-update "
            "group the others formed at start (or set train.weight_sync=disk)",
        )
    if cfg.cluster.kind == "slurm" and cfg.cluster.submit_mode == "hetjob":
        raise ConfigError(
            "inference.on_server_exit",
            "restart",
            "drop or fail with cluster.submit_mode=hetjob: the roles of one heterogeneous job share its fate, so "
            "a dead server ends the whole job; restart the servers with cluster.submit_mode=per_role, or steps "
            "(inside `python -m hpcrl.sbatch hetjob`)",
        )


def check_elastic_fleet(cfg: Config) -> None:
    """allocation.server.min_workers: servers leave and join a running run, which goes on while at least that many
    are live. A server that joins gets the weights from disk, and on Slurm each server is a job of its own."""
    for role in ("trainer", "critic"):
        got = getattr(cfg.allocation, role).min_workers
        require(got is None, f"allocation.{role}.min_workers", got, "null (only the servers are an elastic fleet)")
    least, server = cfg.allocation.server.min_workers, cfg.allocation.server
    if least is None:
        return
    where = "allocation.server.min_workers"
    expected = f"an integer in [1, allocation.server.workers={server.workers}]"
    require(1 <= least <= server.workers, where, least, expected)
    if cfg.train.weight_sync != "disk":
        expected = "null with train.weight_sync=distributed: a server that joins cannot enter the weight-update group"
        raise ConfigError(where, least, expected + " the others formed at start (or set train.weight_sync=disk)")
    if cfg.inference.on_server_exit == "fail":
        raise ConfigError(where, least, "null with inference.on_server_exit=fail (or set it to drop or restart)")
    if cfg.cluster.kind == "slurm" and cfg.cluster.submit_mode != "per_role":
        expected = "null unless cluster.submit_mode=per_role, where each server is a Slurm job of its own"
        raise ConfigError(where, least, f"{expected} (got cluster.submit_mode={cfg.cluster.submit_mode})")


def check_reward(r: RewardConfig) -> None:
    specs = [r.fn] if isinstance(r.fn, str) else r.fn
    expected = "'package.module:function', importable in every process, or a non-empty list of them"
    require(isinstance(specs, list) and bool(specs), "reward.fn", r.fn, expected)
    for spec in specs:
        module, sep, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
        ok = bool(sep) and all(part.isidentifier() for part in [*module.split("."), name])
        require(ok, "reward.fn", r.fn, expected)
    names = [spec.partition(":")[2] for spec in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    why = "functions of distinct names: each one's part is logged as reward/<name>, and two are called"
    require(not twice, "reward.fn", r.fn, f"{why} {', '.join(twice)}")
    if r.weights:
        expected = f"one number per function of reward.fn (a list of {len(specs)}), or [] for 1 each"
        require(isinstance(r.fn, list) and len(r.weights) == len(specs), "reward.weights", r.weights, expected)
        require(all(math.isfinite(w) for w in r.weights), "reward.weights", r.weights, "finite numbers")
    require(r.timeout_s > 0, "reward.timeout_s", r.timeout_s, "seconds > 0")
    one_of("reward.on_error", r.on_error, ("drop", "zero", "fail"))
    require(r.workers >= 1, "reward.workers", r.workers, "an integer >= 1")
    judge = r.judge
    require(judge.max_new_tokens >= 1, "reward.judge.max_new_tokens", judge.max_new_tokens, "an integer >= 1")
    require(judge.temperature >= 0, "reward.judge.temperature", judge.temperature, "a temperature >= 0")


def check_reward_model(cfg: Config, allocation: AllocationConfig) -> None:
    """A reward model's directory exactly when it has servers (``allocation.reward_model.workers``), and a kind
    its servers know how to serve."""
    model, workers = cfg.reward.model, allocation.reward_model.workers
    one_of("reward.model.kind", model.kind, REWARD_MODEL_KINDS)
    if not workers:
        expected = '"" without reward-model servers (or serve it: allocation.reward_model.workers=1, or +rm:cpu:d1)'
        require(not model.path, "reward.model.path", model.path, expected)
        return
    expected = f"the reward model's directory (Hugging Face layout) with allocation.reward_model.workers={workers}"
    require(bool(model.path), "reward.model.path", model.path, expected)
    require(os.path.isdir(os.path.expanduser(model.path)), "reward.model.path", model.path, "an existing directory")


def check_eval(e: EvalConfig) -> None:
    require(e.every_steps >= 0, "eval.every_steps", e.every_steps, "an integer >= 0 (0 = before and after only)")
    require(0 <= e.stop_at_accuracy <= 1, "eval.stop_at_accuracy", e.stop_at_accuracy, "a fraction in [0, 1]")


LOGGERS = ("tensorboard", "wandb")


def check_metrics(m: MetricsConfig) -> None:
    every, count = m.samples_every_steps, m.samples_per_log
    require(every >= 0, "metrics.samples_every_steps", every, "an integer >= 0 (0 = never)")
    require(count >= 1, "metrics.samples_per_log", count, "an integer >= 1")
    for name in m.loggers:
        one_of("metrics.loggers", name, LOGGERS)
    require(len(set(m.loggers)) == len(m.loggers), "metrics.loggers", m.loggers, "each logger at most once")
    one_of("metrics.wandb.mode", m.wandb.mode, ("offline", "online", "disabled"))
    require(bool(m.wandb.project), "metrics.wandb.project", m.wandb.project, "a project name")


def check_recover(cfg: Config) -> None:
    one_of("recover.mode", cfg.recover.mode, ("off", "auto"))
