"""Typed schemas of every config node.

Hydra composes YAML from ``conf/`` onto these dataclasses (registered once in ``store.py``), so a
misspelled key or a value of the wrong type fails at composition. Ranges and cross-field rules are
checked by ``checks.py`` before anything starts. Every field carries a one-line comment with its
unit or meaning; ``docs`` tooling reads these comments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SERVER_BACKENDS = ("cpu", "sglang")
TRAINER_BACKENDS = ("fsdp",)


@dataclass
class RunConfig:
    root: str = "runs"  # directory holding every experiment's run directories
    experiment: str = "default"  # experiment name: the run directory is <root>/<experiment>/<trial>
    trial: str = "run"  # trial name (conf/config.yaml makes it a timestamp); set it to resume a run
    seed: int = 0  # seed for data order, sampling and model init
    max_steps: int = 200  # step budget: the run stops after this many train steps; 0 = only evaluate model.path
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR
    dry_run: bool = False  # validate, print the config and stop; writes a new run's config.yaml, submits nothing


@dataclass
class RoleAllocation:
    backend: str = "cpu"  # server: cpu | sglang; trainer and critic: fsdp
    workers: int = 1  # servers: independent server instances; trainer, critic: torchrun ranks (world size)
    gpus_per_worker: int | None = None  # GPUs a worker owns; null: sglang tp_size, fsdp 1, critic the trainer's
    tp_size: int = 1  # tensor-parallel ranks of one server (sglang: GPUs; cpu: ranks joining the weight group)
    nodes: int = 0  # nodes the role spans; 0 = the fewest that fit
    min_workers: int | None = None  # servers: an elastic fleet, going on while this many live; null = not elastic


@dataclass
class AllocationConfig:
    spec: str = ""  # one-line shorthand, e.g. "sglang:d4t2+fsdp:d8+critic:d2"; when set it replaces the roles below
    server: RoleAllocation = field(default_factory=lambda: RoleAllocation(backend="cpu"))  # inference servers
    trainer: RoleAllocation = field(default_factory=lambda: RoleAllocation(backend="fsdp", workers=2))  # trainers
    critic: RoleAllocation = field(default_factory=lambda: RoleAllocation(backend="fsdp", workers=0))  # 0 = no critic
    reward_model: RoleAllocation = field(default_factory=lambda: RoleAllocation(workers=0))  # its servers; 0 = none

    def roles(self) -> dict[str, RoleAllocation]:
        """The roles that run: server and trainer, and the critic and the reward model when they have workers."""
        roles = {"server": self.server, "trainer": self.trainer}
        if self.critic.workers:
            roles["critic"] = self.critic
        if self.reward_model.workers:
            roles["reward_model"] = self.reward_model
        return roles


@dataclass
class NetConfig:
    family: str = "auto"  # address family to advertise: auto (IPv4, then IPv6) | ipv4 | ipv6
    interface: str = ""  # network interface whose address workers advertise, e.g. ib0; "" = discover
    advertise_host: str = ""  # address workers advertise to the controller; "" = discover
    bind_host: str = ""  # address servers bind; "" = every interface of the advertised family
    port_min: int = 0  # first port of the range workers take ports from; 0 = default below ephemeral range
    port_max: int = 0  # one past the last port of that range; 0 = default below ephemeral range


@dataclass
class RoleResources:
    setup_timeout_s: float = 600.0  # seconds every worker of the role gets to become ready, from its job's start
    cpus_per_worker: int = 1  # CPU cores per worker (Slurm --cpus-per-task); on Slurm a trainer/critic rank's threads
    mem_gb: float = 0.0  # memory per node in GiB; 0 = the scheduler's default
    partition: str = ""  # Slurm partition for this role; "" = cluster.partition
    account: str | None = None  # Slurm account for this role; null = cluster.account, "" = the user's default
    qos: str | None = None  # Slurm QOS for this role; null = cluster.qos, "" = the partition's default
    constraint: str | None = None  # Slurm --constraint (node features) for this role; null = cluster's, "" = none
    time_min: int = 0  # Slurm time limit for this role in minutes; 0 = cluster.time_min
    extra_sbatch: list[str] = field(default_factory=list)  # sbatch options over cluster.extra_sbatch (same name: this)
    env: dict[str, str] = field(default_factory=dict)  # environment variables for this role's workers
    setup: list[str] = field(default_factory=list)  # shell lines run before this role's workers start


def _default_roles() -> dict[str, RoleResources]:
    # model loading on big clusters can take well over 5 minutes: servers get 20, trainers 10
    return {
        "server": RoleResources(setup_timeout_s=1200.0),
        "trainer": RoleResources(setup_timeout_s=600.0),
    }


@dataclass
class ControllerJob:
    partition: str = ""  # partition of the controller job; "" = cluster.partition
    account: str | None = None  # account of the controller job; null = cluster.account, "" = the user's default
    qos: str | None = None  # QOS of the controller job; null = cluster.qos, "" = the partition's default
    constraint: str | None = None  # --constraint of the controller job; null = cluster.constraint, "" = none
    extra_sbatch: list[str] = field(default_factory=list)  # sbatch options over cluster.extra_sbatch (same name: this)
    time_min: int = 0  # time limit of the controller job in minutes; 0 = cluster.time_min
    cpus: int = 2  # CPU cores of the controller job
    mem_gb: float = 8.0  # memory of the controller job in GiB
    signal_delay_s: int = 60  # Slurm sends USR2 this long before the time limit: checkpoint, then requeue
    max_requeues: int = 3  # times the controller job may requeue itself at its time limit (preemptions: always)


@dataclass
class ClusterConfig:
    name: str = "local"  # site name, for logs and job names
    kind: str = "local"  # local (subprocesses on this machine) | slurm
    gpus_per_node: int = 0  # GPUs on one node; allocations must fit it
    cpus_per_node: int = 0  # CPU cores on one node; 0 = do not check
    queue_timeout_min: int = 0  # slurm: the longest a worker job may wait in the queue; 0 = no limit
    worker_lease_s: float = 30.0  # seconds a worker lives without the controller's heartbeat; silent this long: lost
    hang_timeout_s: float = 1800.0  # seconds a trainer/critic call may run; past it the run ends with a hang report
    submit_mode: str = "hetjob"  # slurm: hetjob (one het job) | per_role | steps (inside `hpcrl.sbatch hetjob`)
    partition: str = ""  # Slurm partition; "" = the site's default
    account: str = ""  # Slurm account; "" = the user's default
    qos: str = ""  # Slurm QOS; "" = the partition's default
    time_min: int = 60  # Slurm time limit of worker jobs in minutes
    constraint: str = ""  # Slurm --constraint (node features) of every job, e.g. h100; "" = none
    extra_sbatch: list[str] = field(default_factory=list)  # extra sbatch options for every job; a role's win
    env: dict[str, str] = field(default_factory=dict)  # environment variables for every worker
    setup: list[str] = field(default_factory=list)  # shell lines run before every worker, e.g. module load
    roles: dict[str, RoleResources] = field(default_factory=_default_roles)  # per-role resources and timeouts
    controller: ControllerJob = field(default_factory=ControllerJob)  # the controller's own Slurm job
    net: NetConfig = field(default_factory=NetConfig)  # addresses and ports

    def server_wait_s(self) -> float:
        """How long a request may wait for a restarting inference server (inference.on_server_exit=restart):
        the servers' setup timeout, plus on Slurm the queue timeout, or the worker jobs' time limit when the
        queue has none (no worker outlives it anyway)."""
        setup_s = self.roles["server"].setup_timeout_s
        if self.kind != "slurm":
            return setup_s
        return setup_s + 60 * (self.queue_timeout_min or self.time_min)


@dataclass
class KLConfig:
    # where the term goes and which estimator, checked together (checks.py, KL_COMBINATIONS): loss+k2 | reward+k1
    coef: float = 0.0  # weight of KL(policy || reference), the frozen initial policy; 0 = off (no reference model)
    place: str = "loss"  # loss: a per-token loss term | reward: a per-token penalty in the return (PPO for RLHF)
    estimator: str = "k2"  # k1: log(pi/ref) | k2: log(pi/ref)^2 / 2 | k3: ref/pi - log(ref/pi) - 1


@dataclass
class OffPolicyConfig:
    # the correction of the gap between the servers' (behaviour) and the trainer's logprobs (off_policy.py)
    kind: str = "none"  # none | tis | mis_token | mis_sequence | icepop; the ratio is then against the trainer's
    cap: float = 2.0  # tis: the importance weight is truncated at this cap
    low: float = 0.5  # mis_token, mis_sequence, icepop: a ratio below this is masked out
    high: float = 2.0  # mis_token, mis_sequence, icepop: a ratio above this is masked out


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # label in logs and metrics; behaviour comes from the fields below
    advantage: str = "group_norm"  # group_norm: (r-mean)/std in group | group_center: r-mean | batch_norm | gae
    loss_agg: str = "seq_mean_token_mean"  # seq_mean_token_mean | token_mean | seq_mean_token_sum_norm
    group_size: int = 8  # samples per prompt
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low
    clip_high: float = 0.2  # the ratio is clipped above at 1 + clip_high (DAPO: clip-higher, 0.28)
    kl: KLConfig = field(default_factory=KLConfig)  # the KL regulariser to the reference policy
    kl_coef: float | None = None  # renamed algorithm.kl.coef; setting it is an error that says so
    kl_estimator: str | None = None  # renamed algorithm.kl.estimator (and algorithm.kl.place); an error if set
    drop_equal_reward_groups: bool = False  # drop groups whose rewards are all equal (DAPO dynamic sampling)
    behavior_weight_cap: float = 0.0  # decoupled objective: cap on the behaviour importance weight; 0 = off
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)  # rollout/trainer mismatch correction
    behaviour_logprobs: str = "server"  # server: as sampled | recompute: the trainer's, pre-update (servers send none)
    std_eps: float = 1e-6  # added to the group's reward std before dividing
    updates_per_batch: int = 2  # the batch is split in this many disjoint minibatches, one optimizer update each
    shuffle_minibatches: bool = False  # minibatches of samples drawn at random (seeded), not of whole groups in order
    gamma: float = 1.0  # advantage=gae: discount per response token
    lam: float = 0.95  # advantage=gae: GAE's lambda (1 = Monte Carlo returns minus values, 0 = one-step TD error)
    value_clip: float = 0.2  # advantage=gae: the critic's values move at most this far per update; 0 = no clipping


@dataclass
class TinyModelConfig:
    hidden_size: int = 64  # width of the tiny model
    num_layers: int = 2  # decoder layers of the tiny model
    num_heads: int = 4  # attention heads of the tiny model
    intermediate_size: int = 256  # MLP width of the tiny model


@dataclass
class ModelConfig:
    source: str = "tiny"  # tiny: made from model.tiny in the run directory | local: the directory model.path
    path: str = ""  # local Hugging Face model directory (source=local)
    critic_path: str = ""  # the critic's start: a value model or causal-LM directory; "" = the policy's weights
    dtype: str = "float32"  # float32 | bfloat16 | float16
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # sizes of the tiny model (source=tiny)


@dataclass
class DatasetConfig:
    name: str = "mod10"  # mod10: synthetic "a+b=" -> (a+b) mod 10 | files: local jsonl/parquet
    train_files: list[str] = field(default_factory=list)  # files for name=files
    eval_files: list[str] = field(default_factory=list)  # held-out files for name=files
    prompt_column: str = "prompt"  # column holding the prompt
    answer_column: str = "answer"  # column holding the reference answer
    prompt_template: str = "{prompt}"  # Python format string applied to each row's string prompt
    chat_template: str = "auto"  # the tokenizer's chat template on string prompts: true | false | auto (if it has one)
    train_size: int = 2000  # rows made for a synthetic training set
    eval_size: int = 200  # mod10: rows made for its held-out set (files: dataset.holdout or dataset.eval_files)
    holdout: int = 200  # files without eval_files: rows of train_files held out for evaluation (drawn with run.seed)


# Qwen2/Llama-style decoder layers: attention's four projections and the MLP's three (not the embeddings or lm_head)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    rank: int = 0  # LoRA adapters of this rank on the policy, trained instead of its weights; 0 = off (full weights)
    alpha: float = 16.0  # the adapter's scale is alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input while training
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # module names that get adapters


@dataclass
class TrainConfig:
    lr: float = 5e-4  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    warmup_steps: int = 0  # linear LR warm-up, in run steps (each counts algorithm.updates_per_batch updates)
    lr_schedule: str = "constant"  # constant | cosine (after warm-up; 0 after the run's last update)
    micro_batch_tokens: int = 8192  # tokens per micro-batch on one rank
    critic_lr: float = 2e-3  # the critic's AdamW learning rate (its other settings are the ones above)
    weight_sync: str = "disk"  # how trainers push weights to servers: disk | distributed
    weight_sync_bucket_mb: int = 512  # distributed: MiB at most per /update_weights_from_distributed call
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA adapters instead of full fine-tuning (rank > 0)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 64  # prompts in one train step's batch (each sampled group_size times)
    max_new_tokens: int = 4  # new tokens per sample; always sent to the server
    temperature: float = 1.0  # sampling temperature; logprobs are of the tempered distribution
    top_p: float = 1.0  # nucleus sampling mass: 1 only (logprobs are the full distribution's; see checks.py)
    top_k: int = -1  # top-k sampling: -1 (off) only, as top_p
    max_concurrent: int = 512  # episodes in flight at once
    max_staleness: int = 0  # max policy versions an episode may lag the trainer; 0 = synchronous
    max_rejected_in_a_row: int = 0  # groups rejected in a row (any cause) that fail the run; 0 = 4 batches' worth
    max_empty_aborts: int = 8  # a sample's answers in a row aborted with no token, not in a weight update, that fail it
    request_timeout_s: float = 120.0  # deadline of one generate request
    stop: list[str] = field(default_factory=list)  # stop strings sent with every rollout request
    workers: int = 0  # rollout worker processes running episodes (workflow + reward); 0 = in the controller


@dataclass
class WorkflowConfig:
    name: str = "single_turn"  # single_turn | multi_turn | best_of_n | majority_vote | pipeline | module:function
    max_turns: int = 2  # multi_turn: the most model turns in one trajectory
    turn_discount: float = 0.9  # multi_turn: reward factor per turn after the first; plug-ins: per completion back
    feedback: str = " no, again: "  # multi_turn: the user turn after a wrong answer (chat-templated if possible)
    n: int = 4  # best_of_n, majority_vote: candidates generated per episode
    verifier: str = ""  # best_of_n: "module:function" scoring candidates like a reward; "" = reward.fn
    stages: list[str] = field(default_factory=lambda: ["{prompt}", "{prompt}{previous}|"])  # pipeline: prompts
    train_on: str = "all"  # scaffolds as rollout: train on all candidates' trajectories | the chosen one
    chat_template: str = ""  # plug-ins: the proxy's chat template: "" = the tokenizer's | tiny_tools | a .jinja file
    tool_parser: str = "hermes"  # plug-ins: how tool calls are read from the model's turns: hermes | tiny | none


@dataclass
class RewardModelConfig:
    path: str = ""  # the reward model's directory (Hugging Face layout), served by allocation.reward_model; "" = none
    kind: str = "generative"  # generative: a judge that answers, /generate | discriminative: a score head, /classify


@dataclass
class JudgeConfig:
    template: str = "{prompt}{completion}"  # llm_judge's prompt: the row's columns, prompt and completion in {braces}
    template_file: str = ""  # a file holding the template instead; "" = template
    pattern: str = "^\\s*[Yy]"  # regex on the judge's answer: a match scores 1, none 0; with a group: its number
    max_new_tokens: int = 8  # tokens the judge may answer with
    temperature: float = 0.0  # the judge's sampling temperature; 0 = greedy


@dataclass
class RewardConfig:
    fn: Any = "hpcrl.reward.builtin:mod10"  # "module:function" imported in each reward process; a list: weighted sum
    weights: list[float] = field(default_factory=list)  # reward.fn as a list: each function's weight; [] = 1 each
    timeout_s: float = 10.0  # seconds one reward call may take before it counts as failed
    on_error: str = "drop"  # a reward that raises or times out: drop its group | zero (score 0) | fail the run
    workers: int = 2  # reward processes (none for a function marked @in_process, such as the builtin mod10)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)  # the reward model, on servers of its own
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the builtin llm_judge's prompt, parsing and sampling


@dataclass
class EvalConfig:
    every_steps: int = 5  # held-out greedy evaluation every this many steps; 0 = only before and after
    stop_at_accuracy: float = 0.9  # stop the run once held-out accuracy reaches this; 0 = never stop early
    reward_fn: str = ""  # the held-out reward "module:function"; "" = reward.fn (e.g. an exact match beside a judge)


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # a resumable checkpoint every this many steps; 0 = none
    keep: int = 2  # complete checkpoints kept, the newest; older ones are deleted once a new one is complete; 0 = all


@dataclass
class ExportConfig:
    every_steps: int = 0  # also keep the model every this many steps in <run dir>/exports/step_NNNNNN/; 0 = final only
    merged: bool = False  # with train.lora: also the base model with the adapter merged in, in <export>/merged/


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline: files in <run dir>/wandb, sent later with `wandb sync` | online | disabled
    project: str = "hpcrl"  # Weights & Biases project
    entity: str = ""  # team or user; "" = the account's default
    name: str = ""  # run name; "" = <run.experiment>/<run.trial>
    tags: list[str] = field(default_factory=list)  # tags of the run


@dataclass
class MetricsConfig:
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])  # besides metrics.jsonl: tensorboard, wandb
    wandb: WandbConfig = field(default_factory=WandbConfig)  # metrics.loggers with wandb (pip install 'hpcrl[wandb]')
    samples_every_steps: int = 10  # every this many steps, a few prompts, completions, rewards logged; 0 = never
    samples_per_log: int = 4  # prompts (each with its group's completions) logged each time


@dataclass
class RecoverConfig:
    mode: str = "off"  # off: start from step 1 | auto: resume from the run directory's newest complete checkpoint


@dataclass
class InferenceConfig:
    mem_fraction_static: float = 0.85  # sglang: share of GPU memory for weights and KV cache
    max_running_requests: int = 256  # the most sequences one server decodes together (one batch)
    batch_wait_ms: float = 2.0  # cpu server: how long a new request waits for others to share its batch
    extra_args: list[str] = field(default_factory=list)  # extra `sglang.launch_server` arguments
    health_poll_s: float = 0.25  # seconds between health checks while a server starts
    weight_update_timeout_s: float = 1800.0  # deadline of one weight-update call to a server (a disk load: minutes)
    context_overflow: str = "drop"  # prompt + max_new_tokens over the context: drop its group | truncate new tokens
    # drop and restart need train.weight_sync=disk; drop needs cluster=local; restart on Slurm starts the
    # server role's job again (cluster.submit_mode=per_role or steps; in one hetjob the roles share its fate)
    on_server_exit: str = "drop"  # a dead server: drop (leaves the pool) | restart (rejoins, current weights) | fail
    max_restarts: int = 3  # inference.on_server_exit=restart: restarts in one run, all servers together


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)  # where the run lives and how long it goes
    allocation: AllocationConfig = field(default_factory=AllocationConfig)  # roles, counts, backends
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # where workers run
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # the RL objective
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy model
    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # prompts and answers
    train: TrainConfig = field(default_factory=TrainConfig)  # optimizer and micro-batching
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # sampling and async bounds
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)  # what one episode runs
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # inference server settings
    reward: RewardConfig = field(default_factory=RewardConfig)  # how completions are scored
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation and early stop
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # resumable checkpoints
    export: ExportConfig = field(default_factory=ExportConfig)  # the trained model in Hugging Face layout
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # where metrics go besides metrics.jsonl
    recover: RecoverConfig = field(default_factory=RecoverConfig)  # resuming a run from its checkpoints
