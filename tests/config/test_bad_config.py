"""Each bad config exits non-zero before anything starts, with one message naming field, value and form."""

import pytest

from hpcrl.config import ConfigError
from hpcrl.reward.judge import LLM_JUDGE
from tests.config.compose import load

# (overrides, the one line hpcrl prints after "hpcrl: config error: ")
CLI_CASES = [
    (["allocation.server.backend=vllm"], "allocation.server.backend='vllm' is invalid: expected one of cpu, sglang"),
    (
        ["allocation.trainer.backend=deepspeed"],
        "allocation.trainer.backend='deepspeed' is invalid: expected one of fsdp",
    ),
    (["allocation.trainer.workers=0"], "allocation.trainer.workers=0 is invalid: expected an integer >= 1"),
    (["allocation.server.workers=-2"], "allocation.server.workers=-2 is invalid: expected an integer >= 1"),
    (
        ["allocation=1node_8gpu"],
        "allocation.server.gpus_per_worker=2 is invalid: expected at most cluster.gpus_per_node=0",
    ),
    (
        ["cluster=slurm", "allocation=sglang:d2t16+fsdp:d8"],
        "allocation.server.gpus_per_worker=16 is invalid: expected at most cluster.gpus_per_node=8",
    ),
    (
        ["allocation=sglang:d4t2+fsdp"],
        "allocation.spec='sglang:d4t2+fsdp' is invalid: expected a backend among cpu, sglang, fsdp, critic, "
        "rm:<server backend> then ':' "
        "in 'fsdp'",
    ),
    (["cluster.hang_timeout_s=0"], "cluster.hang_timeout_s=0.0 is invalid: expected seconds > 0"),
    (
        ["cluster.roles.server.setup_timeout_s=-5"],
        "cluster.roles.server.setup_timeout_s=-5.0 is invalid: expected seconds > 0",
    ),
    (
        ["algorithm.clip_hihg=0.3"],
        "algorithm.clip_hihg='0.3' is invalid: expected a key of algorithm: did you mean 'clip_high'?",
    ),
    (["+trainer.lr=1e-4"], "trainer.lr='1e-4' is invalid: expected a key of the root config: did you mean 'train'?"),
    (
        ["cluster.extra_sbatch=[--exclusive,--constraint=x]"],
        "cluster.extra_sbatch='[--exclusive,--constraint=x]' is invalid: expected a value in Hydra's override syntax",
    ),
    (["workflow.name=tree_search"], "workflow.name='tree_search' is invalid: expected one of"),
    (
        ["workflow.name=best_of_n", "workflow.n=3", "algorithm.group_size=8"],
        "workflow.n=3 is invalid: expected a divisor of algorithm.group_size=8",
    ),
    (["cluster.submit_mode=array"], "cluster.submit_mode='array' is invalid: expected one of hetjob, per_role, steps"),
    (["recover.mode=resume"], "recover.mode='resume' is invalid: expected one of off, auto"),
    (["checkpoint.keep=-1"], "checkpoint.keep=-1 is invalid: expected an integer >= 0 (0 = keep every checkpoint)"),
    (
        ["inference.on_server_exit=restart", "train.weight_sync=distributed"],
        "inference.on_server_exit='restart' is invalid: expected drop or fail with train.weight_sync=distributed",
    ),
    (
        ["inference.on_server_exit=restart", "cluster=slurm_local", "cluster.submit_mode=hetjob"],
        "inference.on_server_exit='restart' is invalid: expected drop or fail with cluster.submit_mode=hetjob",
    ),
    (["inference.max_restarts=-1"], "inference.max_restarts=-1 is invalid: expected an integer >= 0"),
    (
        ["allocation.server.workers=2", "allocation.server.min_workers=3"],
        "allocation.server.min_workers=3 is invalid: expected an integer in [1, allocation.server.workers=2]",
    ),
    (
        ["allocation.server.min_workers=1", "train.weight_sync=distributed"],
        "allocation.server.min_workers=1 is invalid: expected null with train.weight_sync=distributed",
    ),
    (
        ["allocation.server.min_workers=1", "inference.on_server_exit=fail"],
        "allocation.server.min_workers=1 is invalid: expected null with inference.on_server_exit=fail",
    ),
    (
        ["allocation.server.min_workers=1", "cluster=slurm_local", "cluster.submit_mode=hetjob"],
        "allocation.server.min_workers=1 is invalid: expected null unless cluster.submit_mode=per_role",
    ),
    (
        ["allocation.trainer.min_workers=1"],
        "allocation.trainer.min_workers=1 is invalid: expected null (only the servers are an elastic fleet)",
    ),
    (
        ["algorithm.kl_coef=0.1"],
        "algorithm.kl_coef=0.1 is invalid: expected unset: it was renamed, set algorithm.kl.coef instead",
    ),
    (
        ["algorithm.kl.estimator=k3"],
        "algorithm.kl.estimator='k3' is invalid: expected k2 with algorithm.kl.place=loss (in the loss k3",
    ),
    (
        ["algorithm.kl.place=reward"],
        "algorithm.kl.estimator='k2' is invalid: expected k1 with algorithm.kl.place=reward (as a reward penalty",
    ),
    (
        ["algorithm=ppo", "allocation=cpu:d1+fsdp:d2g0"],
        "allocation.critic.workers=0 is invalid: expected an integer >= 1 with algorithm.advantage=gae: GAE needs a "
        "critic's values",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), CLI_CASES, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_bad_config_fails_before_launch_with_one_message(main_cli, tmp_path, overrides, message):
    result = main_cli("run.trial=bad", *overrides)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"hpcrl: config error: {message}"), result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "default" / "bad" / "config.yaml").exists(), "nothing may start on a bad config"


def test_wrong_type_is_reported_by_hydra_with_the_key(main_cli):
    result = main_cli("allocation.trainer.workers=abc")
    assert result.returncode != 0
    assert "Value 'abc' of type 'str' could not be converted to Integer" in result.stderr
    assert "full_key: allocation.trainer.workers" in result.stderr


def test_misspelled_key_in_a_yaml_file_is_reported_with_the_file(main_cli, tmp_path):
    site = tmp_path / "conf" / "cluster"
    site.mkdir(parents=True)
    (site / "mysite.yaml").write_text("name: mysite\nkind: slurm\npartiton: gpu\n")
    result = main_cli(f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "cluster=mysite")
    assert result.returncode != 0
    assert "Key 'partiton' not in 'ClusterConfig'" in result.stderr and "cluster/mysite" in result.stderr


def test_multirun_fails_before_the_launcher_submits(main_cli, tmp_path):
    result = main_cli("-m", "hydra/launcher=submitit_local", "allocation.trainer.workers=0")
    assert result.returncode == 2, result.stderr
    assert "allocation.trainer.workers=0 is invalid" in result.stderr
    assert not list(tmp_path.rglob(".submitit")), "no job may be submitted on a bad config"


@pytest.mark.parametrize(
    ("overrides", "path", "expected"),
    [
        (["cluster.net.port_min=80", "cluster.net.port_max=90"], "cluster.net.port_min", "a port in 1024..65535"),
        (
            ["cluster.net.port_min=30000", "cluster.net.port_max=20000"],
            "cluster.net.port_max",
            "> cluster.net.port_min",
        ),
        (["cluster.net.family=ipv5"], "cluster.net.family", "one of auto, ipv4, ipv6"),
        (["cluster.kind=kubernetes"], "cluster.kind", "one of local, slurm"),
        (["cluster.submit_mode=array"], "cluster.submit_mode", "one of hetjob, per_role"),
        (["cluster=slurm", "allocation.spec=sglang:d4t2+fsdp:d6n4"], "allocation.trainer.nodes", "a divisor"),
        (["cluster=slurm", "allocation.spec=sglang:d8t2n1+fsdp:d8"], "allocation.server.nodes", "enough nodes"),
        (["allocation.spec=cpu:d1+fsdp:d4g0n2"], "allocation.trainer.nodes", "1 on cluster.kind=local"),
        (["allocation.spec=cpu:d1g1+fsdp:d2g0"], "allocation.server.gpus_per_worker", "0 (the cpu server"),
        (["cluster=slurm", "allocation.spec=sglang:d2t2g1+fsdp:d8"], "allocation.server.gpus_per_worker", "tp_size=2"),
        (["allocation.spec=cpu:d1+fsdp:d2t2g0"], "allocation.trainer.tp_size", "1 (tensor parallelism is a server's)"),
        (["algorithm.group_size=1"], "algorithm.group_size", ">= 2"),
        (["algorithm.clip_low=1.5"], "algorithm.clip_low", "[0, 1)"),
        (["algorithm.advantage=magic"], "algorithm.advantage", "one of group_norm"),
        (["algorithm.behavior_weight_cap=0.5"], "algorithm.behavior_weight_cap", "a cap >= 1"),
        (["algorithm.off_policy.kind=is"], "algorithm.off_policy.kind", "one of"),
        ([f"reward.fn={LLM_JUDGE}", "reward.judge.max_new_tokens=0"], "reward.judge.max_new_tokens", ">= 1"),
        ([f"reward.fn={LLM_JUDGE}", "reward.judge.temperature=-1"], "reward.judge.temperature", ">= 0"),
        (["algorithm.off_policy.kind=tis", "algorithm.off_policy.cap=0"], "algorithm.off_policy.cap", "> 0"),
        (["algorithm.off_policy.kind=icepop", "algorithm.off_policy.low=1.5"], "algorithm.off_policy.low", "[0, 1]"),
        (["algorithm.off_policy.kind=mis_token", "algorithm.off_policy.high=0.9"], "algorithm.off_policy.high", ">= 1"),
        (["algorithm.behaviour_logprobs=trainer"], "algorithm.behaviour_logprobs", "one of"),
        (
            ["algorithm.behaviour_logprobs=recompute", "algorithm.off_policy.kind=tis"],
            "algorithm.off_policy.kind",
            "every importance ratio would be 1",
        ),
        (
            ["algorithm.behaviour_logprobs=recompute", "algorithm.behavior_weight_cap=5"],
            "algorithm.behavior_weight_cap",
            "every importance ratio would be 1",
        ),
        (["rollout.max_staleness=-1"], "rollout.max_staleness", "an integer >= 0"),
        (["rollout.temperature=0"], "rollout.temperature", "a number > 0"),
        (["rollout.top_p=0.9"], "rollout.top_p", "1.0 for training rollouts (the servers would sample from the trunc"),
        (["rollout.top_k=5"], "rollout.top_k", "-1 (off) for training rollouts"),
        (["train.lr=0"], "train.lr", "a number > 0"),
        (["train.weight_sync=nfs"], "train.weight_sync", "one of disk, distributed"),
        (["train.lora.rank=-1"], "train.lora.rank", "an integer >= 0 (0 = no LoRA"),
        (["train.lora.rank=8", "allocation.spec=cpu:d1t2+fsdp:d1g0"], "allocation.server.tp_size", "1 with train.lora"),
        (["train.lora.alpha=0"], "train.lora.alpha", "a number > 0"),
        (["train.lora.dropout=1.0"], "train.lora.dropout", "a probability in [0, 1)"),
        (["train.lora.target_modules=[]"], "train.lora.target_modules", "a non-empty list of module names"),
        (["model=local"], "model.path", "a local model directory"),
        (["model.tiny.num_heads=3"], "model.tiny.num_heads", "a divisor of hidden_size=128"),
        (["dataset=files"], "dataset.train_files", "files for name=files"),
        (["run.trial=a/b"], "run.trial", "without '/'"),
        (["run.max_steps=-1"], "run.max_steps", "an integer >= 0 (0 = evaluate model.path only, train nothing)"),
        (["algorithm.advantage=gae"], "allocation.critic.workers", "an integer >= 1 with algorithm.advantage=gae"),
        (["allocation.critic.workers=1"], "allocation.critic.workers", "0 with algorithm.advantage=group_norm"),
        (["algorithm=reinforce_pp", "model.critic_path=/x"], "model.critic_path", '"" without a critic'),
        (["algorithm=ppo", "allocation.critic.workers=-1"], "allocation.critic.workers", "an integer >= 0"),
        (["algorithm=ppo", "allocation.critic.gpus_per_worker=1"], "allocation.critic.gpus_per_worker", "at most"),
        (["algorithm=ppo", "allocation.critic.tp_size=2"], "allocation.critic.tp_size", "1 (tensor parallelism"),
        (["algorithm=ppo", "algorithm.lam=1.5"], "algorithm.lam", "[0, 1]"),
        (["algorithm=ppo", "algorithm.gamma=-0.1"], "algorithm.gamma", "[0, 1]"),
        (["algorithm=ppo", "algorithm.value_clip=-1"], "algorithm.value_clip", ">= 0 (0 = no value clipping)"),
        (["algorithm=ppo", "train.critic_lr=0"], "train.critic_lr", "a number > 0"),
        (["algorithm=ppo", "allocation.spec=cpu:d1+fsdp:d2g0+critic:d2g0n2"], "allocation.critic.nodes", "1 on"),
        (
            ["train.lr_schedule=cosine", "train.warmup_steps=10", "run.max_steps=10"],
            "train.warmup_steps",
            "fewer than run.max_steps=10 with train.lr_schedule=cosine",
        ),
        (
            ["rollout.prompts_per_step=3", "algorithm.updates_per_batch=4"],
            "algorithm.updates_per_batch",
            "at most 3: a step's batch holds 3 groups (rollout.prompts_per_step), and each update takes whole groups",
        ),
        (
            [
                "rollout.prompts_per_step=1",
                "algorithm.group_size=2",
                "algorithm.updates_per_batch=3",
                "algorithm.shuffle_minibatches=true",
            ],
            "algorithm.updates_per_batch",
            "at most 2: a step's batch holds 2 samples (rollout.prompts_per_step=1 x algorithm.group_size=2)",
        ),
    ],
)
def test_checks_name_the_field_and_the_expected_form(overrides, path, expected):
    with pytest.raises(ConfigError) as err:
        load(*overrides)
    assert err.value.path == path
    assert expected in err.value.expected
    assert str(err.value).startswith(f"{path}=")


def test_lora_with_a_critic_is_refused_naming_the_rank():
    from dataclasses import replace

    from hpcrl.config.checks import check_lora_critic

    cfg = load("algorithm=ppo")
    check_lora_critic(cfg)  # no adapter: the critic trains as before
    cfg = replace(cfg, train=replace(cfg.train, lora=replace(cfg.train.lora, rank=8)))
    with pytest.raises(ConfigError, match=r"^train\.lora\.rank=8 is invalid: expected 0 with a critic"):
        check_lora_critic(cfg)
