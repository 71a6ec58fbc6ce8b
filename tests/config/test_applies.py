"""No setting silently ignored: every field of the schema is classified (hpcrl/config/applies.py), and one that does
not apply in a run's mode is named in the run's warning (set by a file) or refused (given on the command line)."""

import copy
import dataclasses
import itertools
import logging

import pytest

from hpcrl.config import applies
from hpcrl.config.applies import ALWAYS, RULES, leaves, notes, refuse_given, rules_for, unused, unused_line
from hpcrl.config.errors import ConfigError
from hpcrl.config.hydra import compose_config
from hpcrl.config.schema import Config
from tests.config.compose import load
from tests.conftest import CONF_DIR

FIELDS = {key: default for key, _, default in leaves(Config(), Config())}
WORKFLOWS = ("single_turn", "multi_turn", "best_of_n", "majority_vote", "pipeline", "mytasks.flows:agent")
ALGORITHMS = sorted(p.stem for p in (CONF_DIR / "algorithm").glob("*.yaml"))
# the other settings the rules decide on, each at a value where its rules hold and one where they do not
DECIDING = {
    "dataset.name": ("files", "mod10"),
    "dataset.eval_files": ([], ["held_out.jsonl"]),
    "model.source": ("local", "tiny"),
    "algorithm.kl.coef": (0.02, 0.0),
    "algorithm.updates_per_batch": (2, 1),
    "checkpoint.every_steps": (5, 0),
    "metrics.loggers": (["tensorboard", "wandb"], ["tensorboard"]),
    "metrics.samples_every_steps": (10, 0),
    "reward.fn": (["a.b:c", "a.b:llm_judge"], "a.b:c"),
    "inference.on_server_exit": ("restart", "drop"),
    "cluster.kind": ("slurm", "local"),
    "train.lora.rank": (8, 0),
    "allocation.reward_model.workers": (1, 0),
}
LAUNCHERS = ("submitit_slurm", "basic")  # hydra/launcher, as DECIDING's
# algorithm.off_policy.kind has three kinds of mode (a cap, a band, neither): cycled over the workflows
OFF_POLICY_KINDS = ("tis", "icepop", "none")


def set_at(cfg, key: str, value) -> None:
    *path, name = key.split(".")
    node = applies.value_at(cfg, ".".join(path)) if path else cfg
    if isinstance(node, dict):
        node[name] = value
    else:
        setattr(node, name, value)


def other_than(value):
    """A value of the same kind as ``value`` and not equal to it (the rules never read a setting's own value)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, "x"]
    if isinstance(value, dict):
        return {**value, "X": "1"}
    return "x"  # None: unset


@pytest.fixture(scope="module")
def modes():
    """Every workflow x algorithm preset x server backend x weight sync, each with the deciding settings above all at
    the values where their rules hold, then all where they do not."""
    found = []
    for algorithm in ALGORITHMS:
        base = load(f"algorithm={algorithm}")
        shapes = itertools.product(WORKFLOWS, ("cpu", "sglang"), ("disk", "distributed"), (0, 1))
        for workflow, backend, sync, side in shapes:
            cfg = copy.deepcopy(base)
            cfg.workflow.name, cfg.allocation.server.backend, cfg.train.weight_sync = workflow, backend, sync
            cfg.algorithm.off_policy.kind = OFF_POLICY_KINDS[WORKFLOWS.index(workflow) % len(OFF_POLICY_KINDS)]
            for key, values in DECIDING.items():
                set_at(cfg, key, copy.deepcopy(values[side]))
            found.append((f"{algorithm}/{workflow}/{backend}/{sync}/{side}", cfg, LAUNCHERS[side]))
    return found


def holds(rules, cfg, launcher) -> bool:
    values = lambda when: [launcher if k == applies.LAUNCHER else applies.value_at(cfg, k) for k in when.keys]  # noqa: E731
    return all(rule.when.holds(*values(rule.when)) for rule in rules)


CONDITIONAL = sorted(key for key in FIELDS if rules_for(key, from_files=True))


def test_every_field_of_the_schema_is_classified_once():
    for key in FIELDS:
        conditional, always = bool(rules_for(key, from_files=True)), applies.always(key)
        assert conditional != always, f"{key}: classify it in applies.py, in RULES or in ALWAYS (once)"
    for rule in RULES:
        for pattern in rule.keys:
            assert any(applies._at_or_below(key, pattern) for key in FIELDS), f"RULES names {pattern}: no such field"
        for key in rule.when.keys:
            assert key in FIELDS or key == applies.LAUNCHER, f"RULES decides on {key}: no such field"
    for section, names in ALWAYS.items():
        for name in names:
            assert any(applies.always(key) and key.endswith("." + name) for key in FIELDS), f"{section}.{name}?"


def test_each_conditional_field_set_where_it_does_not_apply_is_named_and_where_it_does_is_not(modes):
    seen = {key: set() for key in CONDITIONAL}  # whether each field was seen applying (True) and not (False)
    for mode, base, launcher in modes:
        cfg = copy.deepcopy(base)
        for key in CONDITIONAL:
            if key not in DECIDING:  # dataset.eval_files: at its DECIDING values, away from its default at side 1
                set_at(cfg, key, other_than(FIELDS[key]))
        named = {u.key for u in unused(cfg, launcher)}
        for key in CONDITIONAL:
            applies_here = holds(rules_for(key, True), cfg, launcher)
            seen[key].add(applies_here)
            assert (key in named) != applies_here, f"{mode}: {key} {'named' if key in named else 'not named'}"
        for key in FIELDS:  # a key given: the rules for files' values and those for keys given only
            if holds(rules_for(key), cfg, launcher):
                refuse_given({key: "v"}, cfg, launcher)
            else:
                with pytest.raises(ConfigError, match=f"^{key}='v' is invalid: expected .* beside it: {key} counts"):
                    refuse_given({key: "v"}, cfg, launcher)
    for key, both in seen.items():
        assert both == {True, False}, f"{key}: the modes never {'apply' if False in both else 'leave out'} it"


def test_no_field_that_applies_always_is_named_in_any_mode(modes):
    deciding = {key for rule in RULES for key in rule.when.keys} | {
        "workflow.name",
        "allocation.server.backend",
        "train.weight_sync",
    }
    always = [key for key in FIELDS if applies.always(key) and key not in deciding]
    for mode, base, launcher in modes:
        cfg = copy.deepcopy(base)
        for key in always:
            set_at(cfg, key, other_than(applies.value_at(cfg, key)))
        assert [u.key for u in unused(cfg, launcher) if u.key in always] == [], mode


def test_the_issues_examples_are_named_exactly_where_they_do_nothing(modes):
    # an oracle apart from the table, read from the code that uses each (make_workflow, apply_gae, server_command)
    expected = {
        "workflow.max_turns": lambda c: c.workflow.name != "multi_turn",
        "workflow.n": lambda c: c.workflow.name not in ("best_of_n", "majority_vote"),
        "workflow.tool_parser": lambda c: ":" not in c.workflow.name,
        "workflow.chat_template": lambda c: ":" not in c.workflow.name,
        "algorithm.gamma": lambda c: c.algorithm.advantage != "gae",
        "inference.mem_fraction_static": lambda c: not servers_on(c, "sglang"),
        "inference.extra_args": lambda c: not servers_on(c, "sglang"),
        "inference.batch_wait_ms": lambda c: not generating_on_cpu(c),
        "train.weight_sync_bucket_mb": lambda c: c.train.weight_sync == "disk" or c.train.lora.rank > 0,
    }
    for mode, cfg, launcher in modes:
        for key, does_nothing in expected.items():
            was = applies.value_at(cfg, key)
            set_at(cfg, key, other_than(FIELDS[key]))
            assert (key in {u.key for u in unused(cfg, launcher)}) == does_nothing(cfg), f"{mode}: {key}"
            set_at(cfg, key, was)


def servers_on(cfg, backend: str) -> bool:
    """From inference/worker.py: the policy's servers, and the reward model's where it has workers, each on its own
    backend, all taking the inference settings."""
    rm = cfg.allocation.reward_model
    return cfg.allocation.server.backend == backend or (rm.workers > 0 and rm.backend == backend)


def generating_on_cpu(cfg) -> bool:
    """From the CPU server's two entry points: only generation batches requests (a generative reward model's, not a
    discriminative one's /classify)."""
    rm = cfg.allocation.reward_model
    judge = rm.workers > 0 and rm.backend == "cpu" and cfg.reward.model.kind == "generative"
    return cfg.allocation.server.backend == "cpu" or judge


def test_a_reward_models_sglang_servers_take_the_sglang_settings_beside_the_policys_cpu_servers():
    cfg = load()
    cfg.inference.mem_fraction_static, cfg.inference.extra_args = 0.5, ["--random-seed", "3"]
    cfg.allocation.reward_model.workers, cfg.allocation.reward_model.backend = 1, "sglang"
    assert [u.key for u in unused(cfg)] == [], "the reward model's SGLang servers take them"
    cfg.allocation.reward_model.workers = 0
    assert [u.key for u in unused(cfg)] == [
        "allocation.reward_model.backend",
        "inference.mem_fraction_static",
        "inference.extra_args",
    ], "with no reward-model worker, nothing takes them"
    cfg.allocation.server.backend, cfg.inference.batch_wait_ms = "sglang", 5.0
    cfg.allocation.reward_model.workers, cfg.allocation.reward_model.backend = 1, "cpu"
    assert "inference.batch_wait_ms" not in [u.key for u in unused(cfg)], "a generative reward model generates on it"
    cfg.reward.model.kind = "discriminative"
    assert "inference.batch_wait_ms" in [u.key for u in unused(cfg)], "a classifier on the CPU server batches nothing"


def test_the_controller_jobs_settings_count_under_its_launcher_whatever_runs_the_workers():
    # hydra/launcher=submitit_slurm cluster=local: the controller is a Slurm job, its workers run beside it
    cfg = load()
    cfg.cluster.partition, cfg.cluster.controller.cpus = "cpu", 2
    for launcher in ("submitit_slurm", None):  # None: not known (hpcrl.sbatch, the doctor), so nothing is said
        assert unused(cfg, launcher) == []
        refuse_given({"cluster.partition": "cpu", "cluster.controller.cpus": 2}, cfg, launcher)
    assert [u.key for u in unused(cfg, "basic")] == ["cluster.partition"]  # a file's controller job: not named
    with pytest.raises(ConfigError) as refused:
        refuse_given({"cluster.controller.cpus": 2}, cfg, "basic")
    assert str(refused.value) == (
        "cluster.controller.cpus=2 is invalid: expected -m hydra/launcher=submitit_slurm beside it: "
        "cluster.controller.cpus counts only with hydra/launcher=submitit_slurm (hydra/launcher is basic)"
    )


def test_the_line_names_each_setting_and_why_grouped_by_what_it_lacks():
    cfg = load("workflow.name=best_of_n")
    cfg.workflow.max_turns, cfg.workflow.feedback, cfg.algorithm.gamma = 5, "again", 0.5
    cfg.cluster.roles["trainer"].mem_gb, cfg.cluster.controller.cpus = 64, 9
    assert unused_line(unused(cfg)) == (
        "these settings have no effect in this run: "
        "cluster.roles.trainer.mem_gb (only with cluster.kind=slurm; cluster.kind is local); "
        "algorithm.gamma (only with algorithm.advantage=gae; algorithm.advantage is group_norm); "
        "workflow.max_turns, workflow.feedback (only with workflow.name=multi_turn; workflow.name is best_of_n)"
    )
    assert unused_line([]) == ""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_dtype_the_trainers_do_not_compute_in_is_a_note(dtype):
    cpu = load(f"model.dtype={dtype}")  # cpu_tiny: trainer ranks on CPUs
    gpu = load(f"model.dtype={dtype}", "allocation=1node_8gpu", "cluster=local_gpu")
    if dtype == "bfloat16":
        assert notes(cpu) == [
            "model.dtype=bfloat16: the trainers run on CPUs (allocation.trainer.gpus_per_worker=0) and compute in "
            "float32 (bfloat16 needs a CUDA GPU); the servers generate in bfloat16"
        ]
        assert notes(gpu) == []
    else:  # the trainer does no loss scaling: float32 anywhere
        assert (
            notes(cpu)
            == notes(gpu)
            == [
                "model.dtype=float16: the trainers compute in float32 (float16 training needs loss scaling, which "
                "hpcrl's trainer does not do); the servers generate in float16"
            ]
        )
    assert notes(load()) == []


def test_lora_with_distributed_sync_is_a_note_saying_how_the_adapter_goes():
    assert not [n for n in notes(compose_config(["train.lora.rank=8"])) if "lora" in n]
    cfg = compose_config(["train.lora.rank=8", "train.weight_sync=distributed"])
    assert [n for n in notes(cfg) if "lora" in n] == [
        "train.weight_sync=distributed with train.lora: the adapter goes to the servers in the body of "
        "/load_lora_adapter_from_tensors (SGLang has no collective path for adapters)"
    ]


def test_resuming_a_run_that_writes_no_checkpoint_is_a_note():
    # before: validate logged it before the run's logging was set up, so it went to stdout, ahead of the dry run's YAML
    assert notes(load("recover.mode=auto")) == [
        "recover.mode=auto with checkpoint.every_steps=0: this run writes no checkpoint to resume from"
    ]
    assert notes(load("recover.mode=auto", "checkpoint.every_steps=5")) == []


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def shipped_configs(tiny_model):
    """Every experiment, and every option of every group, each with what it needs to validate."""
    needs = {
        "model=local": [f"model.path={tiny_model}"],
        "dataset=files": ["dataset.train_files=[x.jsonl]"],
        "dataset=gsm8k": ["dataset.train_files=[x.jsonl]"],
        "allocation=1node_8gpu": ["cluster=local_gpu"],
        "allocation=2node_16gpu": ["cluster=slurm"],
        "experiment=gsm8k": ["dataset.train_files=[x.jsonl]"],
        "experiment=mod10_judge": [f"reward.model.path={tiny_model}"],  # its judge: any model directory validates
    }
    for group in ("experiment", "algorithm", "allocation", "cluster", "dataset", "model", "logger"):
        for option in group_options(group):
            chosen = f"{group}={option}"
            yield chosen, load(chosen, *needs.get(chosen, []))


def test_no_shipped_preset_or_experiment_sets_what_does_not_apply_to_it(tiny_model):
    for chosen, cfg in shipped_configs(tiny_model):
        assert unused(cfg) == [], f"{chosen}: {unused_line(unused(cfg))}"
        bf16_on_cpu = chosen == "model=local"  # its bfloat16, with the default allocation's CPU trainers
        assert len(notes(cfg)) == bf16_on_cpu, f"{chosen}: {notes(cfg)}"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("workflow.max_turns=3", "workflow.name=multi_turn beside it: workflow.max_turns counts only with "
         "workflow.name=multi_turn (workflow.name is single_turn)"),
        ("algorithm.gamma=0.9", "algorithm=ppo beside it: algorithm.gamma counts only with algorithm.advantage=gae "
         "(algorithm.advantage is group_norm)"),
        ("inference.mem_fraction_static=0.5", "allocation.server.backend=sglang or allocation.reward_model.backend="
         "sglang with reward-model workers beside it"),
        ("+cluster.roles.server.extra_sbatch=[--exclusive]", "cluster=slurm (or a site's cluster file) beside it"),
        ("allocation.trainer.workers=4", "no allocation.spec beside it: allocation.trainer.workers counts only with "
         "allocation.spec=\"\" (allocation.spec is cpu:d1+fsdp:d2g0)"),
    ],
)  # fmt: skip
def test_a_key_given_where_it_does_not_apply_is_refused_in_one_line(override, expected):
    spec = ["allocation=cpu:d1+fsdp:d2g0"] if override.startswith("allocation.") else []
    with pytest.raises(ConfigError) as refused:
        compose_config([*spec, override])
    assert expected in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "override",
    [
        "train.lr=1e-4",
        "algorithm.group_size=4",
        "checkpoint.every_steps=5",
        "rollout.temperature=0.7",
        "eval.stop_at_accuracy=0.5",
        "recover.mode=auto",
    ],
)
def test_evaluation_only_refuses_a_training_setting_given_beside_it(override):
    key = override.split("=")[0]
    expected = f"run.max_steps >= 1 (training) beside it: {key} counts only with run.max_steps > 0 (run.max_steps is 0)"
    compose_config([override])  # taken by a training run
    with pytest.raises(ConfigError) as refused:
        compose_config(["run.max_steps=0", override])
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_evaluation_only_takes_what_it_uses_and_warns_of_no_training_setting():
    cfg = compose_config(
        ["run.max_steps=0", "rollout.max_new_tokens=4", "dataset.eval_size=50", "model.dtype=bfloat16"]
    )
    assert (cfg.rollout.max_new_tokens, cfg.dataset.eval_size) == (4, 50)
    assert notes(cfg) == []  # the trainers' dtype note is a training run's


def test_a_key_given_where_it_applies_is_taken():
    cfg = compose_config(["workflow.name=multi_turn", "workflow.max_turns=3", "allocation.trainer.workers=2"])
    assert (cfg.workflow.max_turns, cfg.allocation.trainer.workers) == (3, 2)


def test_validate_says_nothing_the_run_says_it_once_after_logging_is_set_up(caplog):
    # before: validate logged the Slurm-only line while Hydra's handler wrote to stdout, before the dry run's YAML
    with caplog.at_level(logging.WARNING):
        cfg = load("cluster.partition=gpu")
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="hpcrl.config.applies"):
        applies.warn(cfg, "basic")
    assert [r.getMessage() for r in caplog.records] == [
        "these settings have no effect in this run: cluster.partition (only with cluster.kind=slurm or "
        "hydra/launcher=submitit_slurm; cluster.kind is local, hydra/launcher is basic)"
    ]


def test_the_run_says_it_on_the_console_once_and_its_stdout_is_the_config(main_cli, tmp_path):
    conf = tmp_path / "site" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text(
        "# @package _global_\nworkflow:\n  n: 8\n  chat_template: tiny_tools\nalgorithm:\n  lam: 0.9\n"
        "inference:\n  mem_fraction_static: 0.7\n  extra_args: [--random-seed, '3']\ncluster:\n  partition: gpu\n"
    )
    result = main_cli("--config-dir", str(tmp_path / "site"), "experiment=mine", "model.dtype=bfloat16",
                      "run.trial=t", "run.dry_run=true")  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "no effect in this run" in line]
    assert "WARNING hpcrl.config.applies: these settings have no effect in this run: " in line
    for named in (
        "cluster.partition (only with cluster.kind=slurm or hydra/launcher=submitit_slurm; cluster.kind is local, "
        "hydra/launcher is basic)",
        "algorithm.lam (only with algorithm.advantage=gae; algorithm.advantage is group_norm)",
        "workflow.n (only with workflow.name=best_of_n|majority_vote; workflow.name is single_turn)",
        "workflow.chat_template (only with workflow.name=module:function (a plug-in); workflow.name is single_turn)",
        "inference.mem_fraction_static, inference.extra_args (only with allocation.server.backend=sglang or "
        "allocation.reward_model.backend=sglang with reward-model workers; allocation.server.backend is cpu, "
        "allocation.reward_model.workers is 0, allocation.reward_model.backend is cpu)",
    ):
        assert named in line
    (note,) = [line for line in result.stderr.splitlines() if "model.dtype=bfloat16" in line]
    assert "the trainers run on CPUs (allocation.trainer.gpus_per_worker=0) and compute in float32" in note
    assert "no effect" not in result.stdout and result.stdout.startswith("run:\n"), "stdout is the config, only"
    log = (tmp_path / "default" / "t" / "logs" / "controller-0.log").read_text()
    assert line.split("] ", 1)[1] in log and note.split("] ", 1)[1] in log


def test_dataclass_fields_walk_into_roles():
    keys = [key for key, _, _ in leaves(load(), Config())]
    assert "cluster.roles.critic.setup_timeout_s" in keys and "cluster.net.port_min" in keys
    assert len(keys) == len(set(keys)) and all(not dataclasses.is_dataclass(FIELDS.get(k)) for k in keys)


def test_cluster_cpus_per_node_is_checked_on_slurm_as_its_comment_says():
    # before: it was read by nothing (0 = do not check, yet no value was checked)
    with pytest.raises(ConfigError) as refused:
        load("cluster=slurm", "allocation=1node_8gpu", "cluster.cpus_per_node=16")  # 4 trainer ranks x 8 cores
    assert str(refused.value) == (
        "cluster.roles.trainer.cpus_per_worker=8 is invalid: expected at most 4: 4 trainer workers share a node of "
        "cluster.cpus_per_node=16 cores (or spread them: allocation.trainer.nodes)"
    )
    assert load("cluster=slurm", "allocation=1node_8gpu", "cluster.cpus_per_node=32").cluster.cpus_per_node == 32
    load("allocation=1node_8gpu", "cluster=local_gpu", "cluster.cpus_per_node=16")  # Slurm's: a local run reads none
