"""``python -m hpcrl.sbatch``: batch scripts a user submits by hand, and the committed ones in slurm/.

Without Slurm: the committed scripts equal what the renderer makes now; overrides with spaces and quotes
reach ``hpcrl.main`` intact; the controller script asks for what the Hydra submitit launcher submits; a dry
run writes and submits nothing; a bad config exits 2 before anything. On the real test Slurm: the
whole-run heterogeneous job and the controller script each run the tiny job to its summary line, and in the
hetjob a dead server restarts as a new srun step (``inference.on_server_exit=restart``).
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from hpcrl.config.checks import check_cluster
from hpcrl.config.hydra import compose_config, register_schema
from hpcrl.config.schema import ClusterConfig
from hpcrl.controller.roles import role_specs
from hpcrl.doctor.testonly import job_script, sbatch_test_only
from hpcrl.launch.base import RoleSpec
from hpcrl.launch.registry import Registry
from hpcrl.launch.slurm.hetjob import HetComponent
from hpcrl.launch.slurm.resources import role_resources
from hpcrl.launch.slurm.scripts import controller_resources
from hpcrl.launch.slurm.steps import AllocationMismatch, check_het_allocation
from hpcrl.sbatch import render
from tests.conftest import CONF_DIR, REPO, user_error
from tests.slurm.conftest import sacct, wait_for_job
from tests.slurm.test_job_on_slurm import check_addresses, check_critic, check_group_on_trainer_node

COMMITTED = {"controller": REPO / "slurm" / "controller.sbatch", "hetjob": REPO / "slurm" / "hetjob.sbatch"}
TINY_JOB = ["run.max_steps=3", "eval.stop_at_accuracy=0", "rollout.prompts_per_step=16"]
SUMMARY_KEYS = {"steps", "wall_s", "eval_accuracy_before", "eval_accuracy_after", "run_dir"}


def sbatch_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.sbatch", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def options(script: str) -> list[dict[str, str]]:
    """The ``#SBATCH`` options of each heterogeneous component, as sbatch reads them."""
    components: list[dict[str, str]] = [{}]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            components.append({})
        elif line.startswith("#SBATCH "):
            for arg in shlex.split(line.removeprefix("#SBATCH ")):
                name, _, value = arg.removeprefix("--").partition("=")
                components[-1][name] = value
    return components


def command(script: str, job_id: str = "42") -> list[str]:
    """The argv of the script's ``exec`` line, as bash runs it in job ``job_id`` with no script arguments."""
    (line,) = [line for line in script.splitlines() if line.startswith("exec ")]
    printf = line.replace("exec ", r"printf '%s\0' ", 1)  # each argument, NUL-terminated
    out = subprocess.run(
        ["bash", "-c", "set --; " + printf],
        env={**os.environ, "SLURM_JOB_ID": job_id},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split("\0")[:-1]


@pytest.mark.parametrize("kind", sorted(COMMITTED))
def test_the_committed_scripts_are_what_the_renderer_makes(kind):
    expected = render(kind, ["cluster=slurm_local"], python="python")
    assert COMMITTED[kind].read_text() == expected, (
        f"slurm/{kind}.sbatch is stale: python -m hpcrl.sbatch {kind} cluster=slurm_local --python python "
        f"--write slurm/{kind}.sbatch"
    )


def test_the_hetjob_script_has_the_controller_then_each_role():
    server, trainer = options(COMMITTED["hetjob"].read_text())[1:]
    controller = options(COMMITTED["controller"].read_text())[0]
    hetjob_controller = options(COMMITTED["hetjob"].read_text())[0]
    assert hetjob_controller == controller
    assert (server["job-name"], trainer["job-name"]) == ("hpcrl-default-server", "hpcrl-default-trainer")
    assert command(COMMITTED["hetjob"].read_text())[-2:] == ["cluster.submit_mode=steps", "run.trial=slurm-42"]


GOLDEN = Path(__file__).resolve().parent / "golden"
PPO_ON_A_GPU_SITE = ["cluster=slurm", "algorithm=ppo", "allocation.spec=sglang:d2t2+fsdp:d8+critic:d4"]


def test_the_whole_run_hetjob_with_a_critic_matches_the_golden_file():
    """algorithm=ppo: the critic is a component of its own after the trainer's, sized by its own allocation (4 ranks
    of 1 GPU under one torchrun) and cluster.roles.critic (8 CPUs a rank in the template site file). Regenerate after
    an intended change with ``HPCRL_UPDATE_GOLDEN=1 pytest tests/slurm``."""
    script = render("hetjob", PPO_ON_A_GPU_SITE, python="python")
    golden = GOLDEN / "sbatch_hetjob_ppo.sbatch"
    if os.environ.get("HPCRL_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text(), f"the script changed; if intended, regenerate {golden} (see the docstring)"
    *_, trainer, critic = options(script)
    assert critic["job-name"] == "hpcrl-default-critic" and script.count("#SBATCH hetjob") == 3
    assert (critic["nodes"], critic["ntasks-per-node"], critic["cpus-per-task"], critic["gpus-per-node"]) == (
        "1", "1", "32", "4"
    )  # fmt: skip
    assert (trainer["cpus-per-task"], trainer["gpus-per-node"]) == ("64", "8")
    assert "the controller (0), server (1), trainer (2), critic (3)" in script


def test_the_critic_takes_its_own_sbatch_settings_and_a_script_without_it_is_refused_for_a_ppo_run():
    overrides = ["cluster=slurm_local", "algorithm=ppo", "allocation.critic.workers=2", "allocation.critic.nodes=2"]
    overrides += ["cluster.roles.critic.cpus_per_worker=3", "cluster.roles.critic.partition=cpu"]
    overrides += ["cluster.roles.critic.time_min=7", 'cluster.roles.critic.setup=["echo critic"]']
    *_, trainer, critic = options(render("hetjob", overrides, python="python"))
    assert (critic["nodes"], critic["ntasks-per-node"], critic["cpus-per-task"]) == ("2", "1", "3")
    assert (critic["partition"], critic["time"]) == ("cpu", "7")
    assert (trainer["partition"], trainer["time"], trainer["cpus-per-task"]) == ("debug", "10", "1")  # one rank
    # the controller inside that job (cluster.submit_mode=steps) checks Slurm's components against the config
    cfg = compose_config(overrides)
    components = [
        HetComponent(spec.role, role_resources(spec, cfg.cluster, spec.role), Path(f"{spec.role}.pkl"))
        for spec in role_specs(cfg)
    ]
    assert [c.role for c in components] == ["server", "trainer", "critic"]
    shape = {"SLURM_JOB_NUM_NODES_HET_GROUP_1": "1", "SLURM_NTASKS_HET_GROUP_1": "1"}  # the server
    shape |= {"SLURM_JOB_NUM_NODES_HET_GROUP_2": "1", "SLURM_NTASKS_HET_GROUP_2": "1"}  # the trainer's torchrun
    critic_shape = {"SLURM_JOB_NUM_NODES_HET_GROUP_3": "2", "SLURM_NTASKS_HET_GROUP_3": "2"}  # a torchrun per node
    env = {"SLURM_JOB_ID": "9", "SLURM_HET_SIZE": "4", **shape, **critic_shape}
    assert check_het_allocation(components, env) == "9"
    with pytest.raises(AllocationMismatch, match=r"has 3 het components; .* needs 4: .*\(server, trainer, critic\)"):
        check_het_allocation(components, {**env, "SLURM_HET_SIZE": "3"})  # a script rendered without the critic
    with pytest.raises(AllocationMismatch, match=r"^critic: het component 3 of Slurm job 9 has 1 nodes and 1 tasks"):
        check_het_allocation(
            components, {**env, "SLURM_JOB_NUM_NODES_HET_GROUP_3": "1", "SLURM_NTASKS_HET_GROUP_3": "1"}
        )


def test_overrides_with_spaces_and_quotes_reach_the_controller_intact(tmp_path):
    # Hydra's grammar wants a value with spaces quoted; the script must hand that override to bash intact
    root = f"'{tmp_path}/runs with \"quotes\", spaces, $HOME and %j'"
    script = render("hetjob", ["cluster=slurm_local", f"run.root={root}"], python=sys.executable)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    expected = [sys.executable, "-m", "hpcrl.main", "cluster=slurm_local", f"run.root={root}"]
    assert command(script) == [*expected, "cluster.submit_mode=steps", "run.trial=slurm-42"]


def test_the_run_directory_is_named_after_the_job_unless_run_trial_is_given():
    """A requeued job keeps its id: the same run.trial, so it finds its checkpoint (tests/slurm/test_preemption.py)."""
    assert (
        command(render("controller", ["cluster=slurm_local"], python="python"), job_id="7")[-1] == "run.trial=slurm-7"
    )
    pinned = command(render("controller", ["cluster=slurm_local", "run.trial=mine"], python="python"))
    assert [arg for arg in pinned if arg.startswith("run.trial=")] == ["run.trial=mine"]


def launcher_options(*overrides: str) -> dict[str, str]:
    """The #SBATCH options submitit writes for the controller job that ``-m hydra/launcher=submitit_slurm``
    submits: the launcher's parameters handed to submitit as the Hydra plugin hands them."""
    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=submitit_slurm", *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    folder, max_num_timeout = params.pop("submitit_folder"), params.pop("max_num_timeout")
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=max_num_timeout)
    generic = {"timeout_min", "mem_gb", "nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node", "name"}
    generic |= {"stderr_to_stdout"}
    executor.update_parameters(**{k if k in generic else f"slurm_{k}": v for k, v in params.items()})
    text = executor._executor._make_submission_file_text("true", "uid")  # the text submitit submits
    return options(text)[0]


def test_the_controller_script_asks_for_what_the_submitit_launcher_submits():
    overrides = ["cluster=slurm_local", "cluster.account=acct", "cluster.qos=high", "run.experiment=exp"]
    overrides += ['cluster.extra_sbatch=["--constraint=cpu","--exclusive"]', 'cluster.setup=["echo ready"]']
    ours = options(render("controller", overrides, python="python"))[0]
    theirs = launcher_options(*overrides)
    same = ["job-name", "partition", "time", "cpus-per-task", "nodes", "account", "qos", "constraint", "exclusive"]
    assert {k: ours.get(k) for k in same} == {k: theirs.get(k) for k in same}
    assert (ours["account"], ours["qos"], ours["constraint"]) == ("acct", "high", "cpu")
    assert ours["mem"].removesuffix("G") == theirs["mem"].removesuffix("GB")  # both GiB to Slurm
    assert "echo ready" in render("controller", overrides, python="python")


def test_the_controller_and_each_role_take_their_own_sbatch_settings_over_the_cluster_s():
    overrides = ["cluster=slurm_local", "cluster.account=acct", "cluster.constraint=h100", "run.experiment=exp"]
    overrides += [
        'cluster.extra_sbatch=["--exclusive","--comment=all"]',
        'cluster.controller.extra_sbatch=["--comment=ctl"]',
    ]
    overrides += ['cluster.controller.constraint=""', "cluster.controller.account=ctl", "cluster.controller.qos=low"]
    overrides += ["cluster.roles.trainer.constraint=a100", 'cluster.roles.trainer.extra_sbatch=["--comment=train"]']
    ours = options(render("controller", overrides, python="python"))[0]
    theirs = launcher_options(*overrides)
    assert "constraint" not in ours and "constraint" not in theirs, "the controller asked for no feature"
    for sbatch in (ours, theirs):
        assert (sbatch["account"], sbatch["qos"], sbatch["comment"], sbatch["exclusive"]) == ("ctl", "low", "ctl", "")
    controller, server, trainer = options(render("hetjob", overrides, python="python"))
    assert "constraint" not in controller and (controller["account"], controller["comment"]) == ("ctl", "ctl")
    assert (server["constraint"], server["account"], server["comment"]) == ("h100", "acct", "all")
    assert (trainer["constraint"], trainer["account"], trainer["comment"]) == ("a100", "acct", "train")


def test_dry_run_prints_the_script_and_command_and_submits_nothing(tmp_path):
    result = sbatch_cli("hetjob", "--dry-run", "cluster=slurm_local", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash") and "#SBATCH hetjob" in result.stdout
    assert "# would run: sbatch " in result.stdout.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_a_bad_config_exits_2_before_anything_is_written(tmp_path):
    result = sbatch_cli("controller", "cluster=slurm_local", "rollout.temperature=0", cwd=tmp_path)
    assert result.returncode == 2
    assert "rollout.temperature" in result.stderr and "0" in result.stderr, result.stderr
    result = sbatch_cli("controller", "cluster=local", cwd=tmp_path)
    assert result.returncode == 2 and "cluster.kind" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_without_sbatch_here_submitting_is_one_line_and_writes_no_script(tmp_path, path_without_slurm):
    # before: a FileNotFoundError traceback, after the script was written into the working directory
    result = sbatch_cli("controller", "cluster=slurm_local", cwd=tmp_path, env={"PATH": path_without_slurm})
    line, hint = user_error(result)
    assert line == "hpcrl: sbatch is not on PATH here, so nothing was written or submitted"
    assert hint.strip().startswith("run this where Slurm's commands are (a login node of the cluster)")
    assert list(tmp_path.iterdir()) == []


def site_file_example(**changes: object) -> ClusterConfig:
    """The site file docs/slurm.md shows, with ``changes`` (what a test cluster lacks) applied."""
    (text,) = re.findall(
        r"```yaml\n# \S+/cluster/mysite.yaml\n(.*?)```", (REPO / "docs" / "slurm.md").read_text(), re.S
    )
    example = OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.create(text), changes)
    cluster = OmegaConf.to_object(example)
    check_cluster(cluster)
    return cluster


@pytest.mark.slurm
def test_the_site_file_in_the_docs_renders_a_controller_job_slurm_can_schedule(slurm_cluster, tmp_path):
    """The site file's workers ask for an h100 feature that the controller's CPU partition lacks (here: no node
    has it): the controller job must not ask for it, or Slurm could never start it."""
    partition = slurm_cluster.partition  # the test cluster's one partition stands in for gpu and cpu
    cluster = site_file_example(partition=partition, account="", controller={"partition": partition})
    controller = controller_resources(cluster, "hpcrl-site-controller")
    assert "constraint" not in controller.sbatch_options() and cluster.constraint == "h100"
    result = sbatch_test_only("sbatch controller", job_script(controller, []))
    assert result.status == "ok", result
    # the workers do ask for it: on this cluster, where no node has it, sbatch refuses them
    trainer = role_resources(RoleSpec("trainer", ["true"], workers=1, cpus_per_worker=1), cluster, "hpcrl-site-trainer")
    assert trainer.sbatch_options()["constraint"] == "h100"
    assert sbatch_test_only("sbatch trainer", job_script(trainer, [])).status == "fail"


def submit_by_hand(kind: str, workdir: Path, experiment: str, *args: str, shape: tuple[str, ...] = ()) -> str:
    """Render the script for cluster=slurm_local (job names with the test's prefix; SHAPE: overrides that change its
    het groups) and sbatch it with ARGS."""
    script = workdir / f"{kind}.sbatch"
    overrides = ["cluster=slurm_local", f"run.experiment={experiment}", *shape]
    write = sbatch_cli(kind, *overrides, "--write", str(script), cwd=workdir)
    assert write.returncode == 0, write.stderr
    result = subprocess.run(
        ["sbatch", "--parsable", str(script), *args], cwd=workdir, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def summary_of(output: Path) -> dict:
    summary = json.loads(output.read_text().strip().splitlines()[-1])
    assert set(summary) >= SUMMARY_KEYS, summary
    return summary


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize(("sync", "algorithm"), [("disk", "grpo"), ("distributed", "ppo")])
def test_the_whole_run_as_one_heterogeneous_job_submitted_by_hand(
    slurm_cluster, job_prefix, tmp_path, tiny_model, sync, algorithm
):
    """The whole-run script's het groups are the controller and the roles (grpo: the reward model's servers a fourth,
    ppo: its critic, each on a fourth node); each role runs as an srun step of its own component."""
    roles = ["server", "trainer"] + (["critic"] if algorithm == "ppo" else ["reward_model"])
    if len(slurm_cluster.nodes) < 1 + len(roles):
        pytest.fail(f"the whole-run hetjob needs {1 + len(roles)} nodes (components never share one); {slurm_cluster}")
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")
    overrides = [f"run.root={tmp_path}", f"train.weight_sync={sync}", f"algorithm={algorithm}", *TINY_JOB]
    shape = [f"algorithm={algorithm}"]
    if algorithm == "grpo":  # a reward model (any model: reward.fn stays mod10) with a server of its own
        shape += ["allocation.reward_model.workers=1", f"reward.model.path={tiny_model}"]
    job_id = submit_by_hand("hetjob", tmp_path, experiment, *overrides, *shape[1:], shape=tuple(shape))
    rows = wait_for_job(job_id, timeout_s=400, components=1 + len(roles))
    output = tmp_path / f"hpcrl-{job_id}.out"
    assert rows[f"{job_id}+0"]["State"] == "COMPLETED", (rows, output.read_text()[-3000:])
    summary = summary_of(output)
    assert summary["steps"] == 3
    names = {key: row["JobName"] for key, row in rows.items() if "+" in key and "." not in key}
    assert names == {f"{job_id}+0": job_prefix.rstrip("-")} | {
        f"{job_id}+{k}": f"{job_prefix}{role}" for k, role in enumerate(roles, start=1)
    }, names
    steps = {key for key in rows if "." in key}  # the roles ran as srun steps of their own components
    for k in range(1, 1 + len(roles)):
        assert any(key.startswith(f"{job_id}+{k}.") for key in steps), (k, steps)
    run_dir = tmp_path / experiment / f"slurm-{job_id}"
    check_addresses(run_dir, "auto")
    if algorithm == "ppo":  # the critic's rank on its own node (component +3), trained every step, exported
        check_critic(run_dir, summary, f"{job_id}+3", nodes=1)
    if sync == "distributed":
        check_group_on_trainer_node(run_dir)


@pytest.mark.slurm
@pytest.mark.slow
def test_the_controller_script_submitted_by_hand_submits_its_workers(slurm_cluster, job_prefix, tmp_path):
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")
    job_id = submit_by_hand("controller", tmp_path, experiment, f"run.root={tmp_path}", *TINY_JOB)
    rows = wait_for_job(job_id, timeout_s=400)
    output = tmp_path / f"hpcrl-{job_id}.out"
    assert rows[job_id]["State"] == "COMPLETED", (rows, output.read_text()[-3000:])
    assert summary_of(output)["steps"] == 3
    workers = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName", "-S", "now-1hours", "--name", f"{job_prefix}server"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    assert workers and workers[0].split("|")[0].endswith("+0"), workers  # the workers' heterogeneous job


@pytest.mark.slurm
@pytest.mark.slow
def test_in_the_whole_run_hetjob_a_dead_server_restarts_as_a_new_step(slurm_cluster, job_prefix, tmp_path):
    experiment = job_prefix.removeprefix("hpcrl-").rstrip("-")
    run = [f"run.root={tmp_path}", "run.trial=t", "run.max_steps=10", "eval.stop_at_accuracy=0"]
    job_id = submit_by_hand(
        "hetjob", tmp_path, experiment, *run, "rollout.prompts_per_step=8", "inference.on_server_exit=restart"
    )
    run_dir = tmp_path / experiment / "t"
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # mid-run: steps are done
        assert time.monotonic() < deadline, f"no training step within 300 s: {sacct(job_id)}"
        time.sleep(0.5)
    (entry,) = Registry(run_dir / "registry").entries("server")
    os.kill(entry.extra["server_pid"], signal.SIGKILL)  # the inference server crashes; srun ends its step
    rows = wait_for_job(job_id, timeout_s=400, components=3)
    output = tmp_path / f"hpcrl-{job_id}.out"
    assert rows[f"{job_id}+0"]["State"] == "COMPLETED", (rows, output.read_text()[-3000:])
    assert summary_of(output)["steps"] == 10
    assert json.loads(metrics.read_text().splitlines()[-1])["servers_restarted"] == 1
    server_steps = sorted(key for key in rows if key.startswith(f"{job_id}+1.") and key.split(".")[1].isdigit())
    assert len(server_steps) == 2, rows  # the server role ran twice in its het group's allocation
