"""What the Slurm scheduler asks for, without a Slurm: the heterogeneous job's batch script (a golden file),
the resources of a role, sbatch options, host lists, the torchrun command of a task and its rendezvous port.

Regenerate the golden file after an intended change with ``HPCRL_UPDATE_GOLDEN=1 pytest tests/slurm``.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from hpcrl.config.schema import ClusterConfig, RoleResources
from hpcrl.launch.base import RoleSpec, WorkerFailed
from hpcrl.launch.registry import Registry
from hpcrl.launch.slots import PortSlots
from hpcrl.launch.slurm import (
    HetComponent,
    SlurmScheduler,
    SlurmWorkerGroup,
    WorkerTask,
    render_hetjob_script,
    role_resources,
)
from hpcrl.launch.slurm.hetjob import ended_first
from hpcrl.launch.slurm.rendezvous import RendezvousPlan, rendezvous_port, step_key
from hpcrl.launch.slurm.resources import parse_extra_sbatch, submitit_parameters
from hpcrl.launch.slurm.task import expand_hostlist, torchrun_argv
from hpcrl.launch.slurm.watch import JobRef, JobState
from hpcrl.rundir import RunDir

GOLDEN = Path(__file__).resolve().parent / "golden"
# spaces, both quotes, a '%' (a Slurm file name placeholder) and a '$' (a shell expansion)
RUN_DIR = Path('/shared/runs/it\'s a "quoted" run $HOME 100%/exp/trial')

CLUSTER = ClusterConfig(
    kind="slurm",
    partition="batch",
    account="rl-team",
    qos="high",
    time_min=90,
    extra_sbatch=["--constraint=h100", "--comment=hpcrl run"],
    env={"HF_HOME": "/shared/hf"},
    setup=["module load cuda/12.4", "source /shared/venv/bin/activate"],
    roles={
        "server": RoleResources(mem_gb=64, setup=["export SGLANG_LOG='a b'"]),
        "trainer": RoleResources(partition="train", time_min=120, mem_gb=1.5, extra_sbatch=["--exclusive"]),
    },
)
SERVER = RoleSpec("server", ["python", "-m", "hpcrl.inference.worker"], workers=4, gpus_per_worker=2, cpus_per_worker=8)
TRAINER = RoleSpec(
    "trainer", ["python", "-m", "hpcrl.train.worker"], workers=16, nodes=2, gpus_per_worker=1, torchrun=True
)


def components() -> list[HetComponent]:
    folder = RUN_DIR / "slurm"
    return [
        HetComponent(spec.role, role_resources(spec, CLUSTER, f"hpcrl-{spec.role}"), folder / f"0123_{spec.role}.pkl")
        for spec in (SERVER, TRAINER)
    ]


def test_hetjob_script_matches_the_golden_file():
    script = render_hetjob_script(components(), RUN_DIR / "slurm", CLUSTER.setup, python="/shared/venv/bin/python")
    golden = GOLDEN / "hetjob_server_trainer.sh"
    if os.environ.get("HPCRL_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text(), f"the script changed; if intended, regenerate {golden} (see module doc)"


def test_hetjob_script_quotes_every_path_as_the_shell_and_sbatch_read_it(tmp_path):
    # run the script's shell part with a stand-in srun that records its arguments
    folder = tmp_path / 'it\'s a "quoted" run $HOME 100%' / "slurm"
    folder.mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$SRUN_ARGS.$$"\necho "srun says hi" >&2\n')
    (bin_dir / "srun").chmod(0o755)
    comps = [HetComponent(c.role, c.resources, folder / f"0123_{c.role}.pkl") for c in components()]
    script = tmp_path / "job.sh"
    script.write_text(render_hetjob_script(comps, folder, ["echo setup ran"], python="/venv/bin/python"))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "SRUN_ARGS": str(tmp_path / "args")}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout == "setup ran\n", result

    calls = [p.read_text().split("\0")[:-1] for p in tmp_path.glob("args.*")]
    calls.sort(key=lambda argv: argv[0])  # --het-group=0 first
    assert [argv[0] for argv in calls] == ["--het-group=0", "--het-group=1"]
    pattern = str(folder).replace("%", "%%")  # srun reads --output as a pattern: a literal '%' is '%%'
    for k, (argv, role) in enumerate(zip(calls, ["server", "trainer"], strict=True)):
        assert argv[argv.index("--output") + 1] == f"{pattern}/77+{k}_%t_log.out"
        assert argv[argv.index("--error") + 1] == f"{pattern}/77+{k}_%t_log.err"
        assert argv[-5:] == [
            "/venv/bin/python",
            "-u",
            "-m",
            "hpcrl.launch.slurm",
            str(folder / f"0123_{role}.pkl"),
        ]
        assert (folder / f"77+{k}_srun.err").read_text() == "srun says hi\n"  # srun's own stderr, per component

    # sbatch splits its #SBATCH lines as a shell does (seen on Slurm 22.05; the live tests use such a path too)
    lines = script.read_text().splitlines()
    output = next(line for line in lines if line.startswith("#SBATCH --output="))
    assert shlex.split(output.removeprefix("#SBATCH --output=")) == [f"{pattern}/%j_batch.out"]


CRITIC = RoleSpec(
    "critic", ["python", "-m", "hpcrl.train.worker", "--role", "critic"], workers=2, gpus_per_worker=1, torchrun=True
)


def test_the_hetjob_script_records_which_component_s_step_ended_first(tmp_path):
    """Every component of a hetjob ends FAILED with the script's status, whichever role failed: the script must
    say which step ended first, or the controller names the first role it checks (the server) for a dead critic."""
    folder = tmp_path / "slurm"
    folder.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # component 2 (the critic) fails at once; the others run on until the script ends them
    srun = '#!/bin/bash\nif [ "$1" = --het-group=2 ]; then exit 3; fi\nexec sleep 30\n'
    (bin_dir / "srun").write_text(srun)
    (bin_dir / "srun").chmod(0o755)
    specs = (SERVER, TRAINER, CRITIC)
    comps = [HetComponent(s.role, role_resources(s, CLUSTER, s.role), folder / f"{s.role}.pkl") for s in specs]
    script = tmp_path / "job.sh"
    script.write_text(render_hetjob_script(comps, folder, python="python"))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77"}
    # its own session, so that the sleeps it leaves behind (Slurm would end them) go with it
    proc = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=20)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 3
    assert ended_first(folder, "77") == 2
    assert "the step of component 2 (critic) ended first, with status 3" in stderr, stderr
    assert ended_first(folder, "78") is None  # a job whose script has recorded nothing (yet)


class _Watcher:
    """Every component of the job has ended in ``state`` (FAILED: as Slurm reports a hetjob whose script exited 1)."""

    def __init__(self, state: str = "FAILED"):
        self.found = JobState(state, "1:0")

    def state(self, job):
        return self.found


def test_every_component_of_a_failed_hetjob_names_the_role_whose_step_ended_first(tmp_path):
    run_dir = RunDir.create(tmp_path, "exp", "trial")
    folder = run_dir.path / "slurm"
    folder.mkdir()
    registry = Registry(run_dir.registry)
    groups = [
        SlurmWorkerGroup(spec, registry, JobRef("77", k), _Watcher(), folder, run_dir)
        for k, spec in enumerate((SERVER, TRAINER, CRITIC))
    ]
    (run_dir.logs / "critic-1.log").write_text("critic rank 1: out of memory\n")
    torchrun = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9\n"
    (folder / "77+2_0_log.err").write_text(torchrun)  # torchrun's report names the rank that died
    with pytest.raises(WorkerFailed, match=r"^server worker job 77\+0 FAILED"):
        groups[0].check_alive()  # a component alone, as before: no record to go by
    for group in groups:
        group.het_groups = groups
    with pytest.raises(WorkerFailed, match=r"^server worker job 77\+0 FAILED"):
        groups[0].check_alive()  # the script recorded nothing: no culprit is made up
    (folder / "77_ended_first").write_text("2\n")
    for group in groups:  # the controller checks the server first, then the trainer, then the critic
        with pytest.raises(WorkerFailed) as err:
            group.check_alive()
        assert (err.value.role, err.value.worker, err.value.state) == ("critic", "job 77+2", "FAILED")
        assert err.value.log_file == run_dir.logs / "critic-1.log" and "out of memory" in str(err.value)
    groups[0].watcher = _Watcher("CANCELLED")  # scancel: every component at once, whichever step ended first
    with pytest.raises(WorkerFailed, match=r"^server worker job 77\+0 CANCELLED"):
        groups[0].check_alive()


def test_role_resources_follow_the_spec_the_role_and_the_cluster():
    server, trainer = (c.resources for c in components())
    assert (server.nodes, server.ntasks_per_node, server.cpus_per_task, server.gpus_per_node) == (1, 4, 8, 8)
    assert (server.partition, server.time_min, server.mem_gb) == ("batch", 90, 64)
    # a torchrun role: one task (torchrun) per node, with the cores of all its ranks there
    assert (trainer.nodes, trainer.ntasks_per_node, trainer.cpus_per_task, trainer.gpus_per_node) == (2, 1, 8, 8)
    assert trainer.sbatch_options() == {
        "job-name": "hpcrl-trainer",
        "nodes": "2",
        "ntasks-per-node": "1",
        "cpus-per-task": "8",
        "time": "120",
        "gpus-per-node": "8",
        "mem": "1536M",
        "partition": "train",
        "account": "rl-team",
        "qos": "high",
        "constraint": "h100",
        "comment": "hpcrl run",
        "exclusive": True,
    }
    assert trainer.srun_args() == [
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=8",
        "--kill-on-bad-exit=1",
    ]


def test_submitit_gets_the_same_options():
    server = components()[0].resources
    params = submitit_parameters(server, CLUSTER.setup)
    assert params["job_name"] == "hpcrl-server" and params["ntasks_per_node"] == 4 and params["mem"] == "64G"
    assert params["additional_parameters"] == {"constraint": "h100", "comment": "hpcrl run"}
    assert params["setup"] == [*CLUSTER.setup, "export SGLANG_LOG='a b'"]
    assert "--cpus-per-task=8" in params["srun_args"]


@pytest.mark.parametrize("bad", ["-C h100", "constraint=h100", "--", "--gres gpu:1"])
def test_extra_sbatch_options_must_be_long_options(bad):
    with pytest.raises(ValueError, match="--name=value or --flag"):
        parse_extra_sbatch([bad])


def test_a_time_limit_below_two_minutes_is_refused():
    with pytest.raises(ValueError, match="time limit must be >= 2 minutes, got 1"):
        role_resources(SERVER, ClusterConfig(kind="slurm", time_min=1), "x")


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-2]", ["n1", "n2"]),
        ("gpu[08-10,3],cpu-a1", ["gpu08", "gpu09", "gpu10", "gpu3", "cpu-a1"]),
    ],
)
def test_hostlists_expand(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def _plan(tmp_path, timeout_s=30.0, port_range=(24000, 24400)) -> RendezvousPlan:
    return RendezvousPlan(
        slot=3, world=4, port_range=port_range, file=tmp_path / "t.rendezvous.json", timeout_s=timeout_s
    )


def test_torchrun_rendezvous_is_hosted_by_the_first_node_of_the_step_at_a_port_chosen_there(tmp_path):
    task = WorkerTask(
        "trainer", ["python", "w.py"], {}, tmp_path, workers=4, nodes=2, torchrun=True, rendezvous=_plan(tmp_path)
    )
    env = {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}
    first = torchrun_argv(task, {**env, "SLURMD_NODENAME": "n1"})  # publishes the port it picked
    second = torchrun_argv(task, {**env, "SLURMD_NODENAME": "n2"})  # reads it
    port = json.loads(task.rendezvous.file.read_text())["port"]
    assert 24300 <= port < 24400, "the port comes from the rendezvous slot's slice (slot 3 of 4)"
    assert "--nnodes=2" in first and "--nproc-per-node=2" in first and "--rdzv-id=42-trainer" in first
    assert f"--rdzv-endpoint=n1:{port}" in first and f"--rdzv-endpoint=n1:{port}" in second
    assert "--rdzv-conf=is_host=1" in first and "--rdzv-conf=is_host=0" in second
    assert first[-3:] == ["--", "python", "w.py"]
    with pytest.raises(RuntimeError, match="expected 2 nodes"):
        torchrun_argv(task, {**env, "SLURM_STEP_NODELIST": "n1", "SLURMD_NODENAME": "n1"})


def test_the_first_node_skips_a_port_taken_on_it(tmp_path):
    plan = _plan(tmp_path, port_range=(24000, 24008))  # slot 3 of 4: ports 24006, 24007
    with socket.socket() as taken:
        taken.bind(("", 24006))
        taken.listen()
        assert rendezvous_port(plan, "42.0.0", first_node=True) == 24007


def test_other_nodes_wait_for_this_step_s_port_and_never_take_a_stale_one(tmp_path):
    plan = _plan(tmp_path, timeout_s=0.6)
    plan.file.write_text(json.dumps({"key": "41.0.0", "host": "n1", "port": 24301}))  # an earlier job's
    with pytest.raises(TimeoutError, match=r"first node of step 42\.0\.0 did not publish"):
        rendezvous_port(plan, "42.0.0", first_node=False)
    later = threading.Timer(0.3, lambda: rendezvous_port(plan, "42.1.0", first_node=True))
    later.start()
    port = rendezvous_port(_plan(tmp_path, timeout_s=10), "42.1.0", first_node=False)
    later.join()
    assert port == json.loads(plan.file.read_text())["port"]
    assert step_key({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "1", "SLURM_RESTART_COUNT": "2"}) == "42.1.2"


def test_a_dry_run_renders_the_hetjob_without_submitting_anything(tmp_path):
    run_dir = RunDir.create(tmp_path, "exp", "trial")
    scheduler = SlurmScheduler(run_dir, PortSlots({"server": 4, "trainer": 16}, rendezvous=("trainer",)), CLUSTER)
    script = scheduler.hetjob_script([SERVER, TRAINER])
    assert script.count("#SBATCH hetjob") == 1 and "--het-group=1" in script
    assert str(run_dir.path / "slurm" / "<uid>_trainer_task.pkl") in script
    assert scheduler.job_ids == [] and not (run_dir.path / "slurm").exists()


def test_specs_the_slurm_scheduler_cannot_run_fail_before_anything_is_submitted(tmp_path):
    run_dir = RunDir.create(tmp_path / "100%", "exp", "trial")
    per_role = ClusterConfig(kind="slurm", submit_mode="per_role")
    scheduler = SlurmScheduler(run_dir, PortSlots({"server": 4}), per_role)
    with pytest.raises(ValueError, match="spec has 2 workers but the run's PortSlots counts 4"):
        scheduler.start(RoleSpec("server", ["w"], workers=2))
    with pytest.raises(ValueError, match="no port slots for role 'trainer'"):
        scheduler.start_all([SERVER, TRAINER])
    with pytest.raises(ValueError, match="must hold no '%'"):
        scheduler.start(SERVER)
    with pytest.raises(ValueError, match="submit_mode must be one of"):
        SlurmScheduler(run_dir, PortSlots({"server": 4}), ClusterConfig(kind="slurm", submit_mode="array"))
    assert scheduler.job_ids == []
