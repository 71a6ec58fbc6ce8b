"""The doctor's checks that need no Slurm: against cluster=local, and a broken setting for each check."""

import shutil
import socket

import pytest

from hpcrl.doctor.checks import Options, load_config, run_checks
from hpcrl.doctor.local import check_address, check_ports
from hpcrl.doctor.nodes import GpuProbe
from hpcrl.net import discover_host, ephemeral_range, has_ipv6, is_port_free
from tests.doctor.conftest import run_doctor


def checks(*overrides: str) -> dict:
    """{check: Result} of the doctor run in this process."""
    return {r.check: r for r in run_checks(list(overrides), Options())}


def test_the_doctor_passes_on_the_local_cluster(tmp_path):
    doctor = run_doctor("cluster=local", f"run.root={tmp_path}")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert {"config", "run root", "address", "ports", "setup timeout", "gpu", "slurm"} <= set(doctor.lines)
    assert {doctor.status(check) for check in doctor.lines} <= {"ok", "skip"}
    assert "cannot run" in doctor.lines["gpu"]  # a CPU cluster: said plainly, not passed off as checked
    assert list(tmp_path.iterdir()) == []  # the doctor leaves nothing in the run root


def test_a_bad_config_is_hpcrl_mains_one_line_and_exit_code_2(tmp_path):
    doctor = run_doctor("allocation.trainer.workers=0", f"run.root={tmp_path}")
    assert doctor.returncode == 2 and doctor.stdout == ""
    expected = "hpcrl: config error: allocation.trainer.workers=0 is invalid: expected an integer >= 1"
    assert doctor.stderr.strip() == expected
    # in-process, run_checks still reports a bad config as its failed first line
    unknown = checks("cluster=no_such_site")["config"]
    assert unknown.status == "fail"
    assert "cluster='no_such_site' is invalid: expected an option of cluster" in unknown.found


def test_an_unwritable_run_root_fails_with_advice(tmp_path):
    (tmp_path / "a_file").write_text("")
    result = checks("cluster=local", f"run.root={tmp_path}/a_file/runs")["run root"]
    assert result.status == "fail"
    assert "Not a directory" in result.found and "run.root=DIR" in result.advice


def test_a_port_range_inside_the_ephemeral_range_fails_with_advice(tmp_path):
    low, _ = ephemeral_range()
    result = checks("cluster=local", f"run.root={tmp_path}", f"cluster.net.port_min={low + 100}",
                    f"cluster.net.port_max={low + 1100}")["ports"]  # fmt: skip
    assert result.status == "fail"
    assert "overlaps the kernel's ephemeral range" in result.found
    assert f"cluster.net.port_max={low}" in result.advice  # the default range ends where the ephemeral one starts


def test_a_slice_of_the_port_range_with_no_free_port_fails(tmp_path):
    # five listeners (the controller, a server, two trainers, the trainers' rendezvous): five slices of one port;
    # one of them taken
    low = next(p for p in range(21000, 30000, 7) if all(is_port_free(p + k) for k in range(5)))
    cfg = load_config(["cluster=local", f"cluster.net.port_min={low}", f"cluster.net.port_max={low + 5}",
                       "allocation.trainer.workers=2"])  # fmt: skip
    assert check_ports(cfg).status == "ok"
    with socket.create_server(("0.0.0.0", low + 2)):
        result = check_ports(cfg)
    assert result.status == "fail" and f"no free port in slice [{low + 2}, {low + 3})" in result.found


def test_a_setup_timeout_shorter_than_the_model_load_fails_with_advice(tmp_path, weights):
    found = checks("cluster=local", f"run.root={tmp_path}", "model=local", f"model.path={weights}",
                   "cluster.roles.server.setup_timeout_s=10", "cluster.roles.trainer.setup_timeout_s=3600")  # fmt: skip
    assert found["setup timeout server"].status == "fail"
    assert "cluster.roles.server.setup_timeout_s=10 s, but the model" in found["setup timeout server"].found
    assert "raise it: cluster.roles.server.setup_timeout_s=" in found["setup timeout server"].advice
    assert found["setup timeout trainer"].status == "ok"


def test_the_port_range_is_cut_as_the_run_cuts_it_with_a_critic(tmp_path):
    """The run's PortSlots: the controller, each worker, and a rendezvous slot for each torchrun role. With the
    critic (algorithm=ppo, 2 ranks) and 2 trainer ranks: 1 + 1 server + 2 trainers + 2 critics + 2 rendezvous = 8
    slices."""
    two = ["allocation.trainer.workers=2"]
    low = next(p for p in range(21000, 30000, 11) if all(is_port_free(p + k) for k in range(8)))
    ports = [f"cluster.net.port_min={low}", f"cluster.net.port_max={low + 7}"]
    result = check_ports(load_config(["cluster=local", "algorithm=ppo", "allocation.critic.workers=2", *two, *ports]))
    assert result.status == "fail" and "has 7 ports for 8 listeners" in result.found, result
    ports = [f"cluster.net.port_min={low}", f"cluster.net.port_max={low + 8}"]
    result = check_ports(load_config(["cluster=local", "algorithm=ppo", "allocation.critic.workers=2", *two, *ports]))
    assert result.status == "ok" and "8 slices of 1" in result.found, result


def test_the_critic_s_setup_timeout_is_checked_against_the_model_load(tmp_path, weights):
    found = checks("cluster=local", f"run.root={tmp_path}", "model=local", f"model.path={weights}", "algorithm=ppo",
                   "cluster.roles.critic.setup_timeout_s=10")  # fmt: skip
    assert found["setup timeout critic"].status == "fail", found["setup timeout critic"]
    assert "cluster.roles.critic.setup_timeout_s=10 s, but the model" in found["setup timeout critic"].found
    assert found["setup timeout trainer"].status == "ok"
    without = checks("cluster=local", f"run.root={tmp_path}", "model=local", f"model.path={weights}")
    assert "setup timeout critic" not in without, "a run without a critic starts none"
    tiny = checks("cluster=local", f"run.root={tmp_path}", "algorithm=ppo")["setup timeout"]
    assert tiny.found.endswith("(server 300 s, trainer 300 s, critic 300 s)"), tiny


def test_the_gpu_probe_job_asks_for_what_the_critic_asks_when_only_the_critic_has_gpus():
    allocation = "allocation=cpu:d1+fsdp:d2g0+critic:d2g1"
    critic = ["cluster.roles.critic.partition=critic-gpus", "+cluster.roles.critic.env.WHERE=critic"]
    cfg = load_config(["cluster=slurm", "algorithm=ppo", allocation, *critic])
    probe = GpuProbe(cfg, "python")
    assert probe.role == "critic"
    res = probe.resources("hpcrl-doctor-gpu")
    assert (res.partition, res.gpus_per_node, res.nodes, res.ntasks_per_node) == ("critic-gpus", 1, 1, 1)
    assert probe.env()["WHERE"] == "critic"


def test_a_loopback_address_fails_on_slurm():
    cfg = load_config(["cluster=slurm_local", "cluster.net.advertise_host=127.0.0.1"])
    result = check_address(cfg)
    assert result.status == "fail" and "loopback" in result.found and "cluster.net.interface" in result.advice


@pytest.mark.skipif(not has_ipv6(), reason="this machine has no IPv6")
def test_an_ipv6_cluster_advertises_an_ipv6_address():
    result = check_address(load_config(["cluster=local", "cluster.net.family=ipv6"]))
    assert result.status == "ok" and "(ipv6)" in result.found and "bind ::" in result.found
    assert discover_host("ipv6") in result.found


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_the_gpu_checks_run_here_on_a_local_gpu_cluster_and_fail_without_gpus(tmp_path):
    found = checks("cluster=local", f"run.root={tmp_path}", "cluster.gpus_per_node=8", "allocation=cpu:d1+fsdp:d2g1")
    assert found["gpu nvidia-smi"].status == "fail" and "nvidia-smi" in found["gpu nvidia-smi"].found
    assert found["gpu torch"].status == "fail" and "0 devices" in found["gpu torch"].found
    assert found["gpu sglang"].status == "skip"  # the cpu server needs no sglang


def test_the_reward_models_weights_and_setup_timeout_are_checked(tmp_path, weights):
    rm = ["allocation.reward_model.workers=1", f"reward.model.path={weights}"]
    found = checks("cluster=local", f"run.root={tmp_path}", *rm, "cluster.roles.server.setup_timeout_s=10")
    result = found["setup timeout reward_model"]  # its resources default to the servers'
    assert result.status == "fail" and "cluster.roles.reward_model.setup_timeout_s=10 s, but the reward model" in (
        result.found
    ), result
    empty = tmp_path / "empty"
    empty.mkdir()
    rm = ["allocation.reward_model.workers=1", f"reward.model.path={empty}"]
    result = checks("cluster=local", f"run.root={tmp_path}", *rm)["setup timeout reward_model"]
    assert result.status == "fail" and "has no weight files" in result.found, result
    assert "setup timeout reward_model" not in checks("cluster=local", f"run.root={tmp_path}")
