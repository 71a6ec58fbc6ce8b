"""The exact command lines of both server backends, and what SGLang's extra arguments may not do."""

import logging

import pytest

from hpcrl.config import ConfigError
from hpcrl.config.schema import LORA_TARGETS, InferenceConfig, LoRAConfig
from hpcrl.inference.commands import server_command
from hpcrl.inference.sglang import SGLANG_SETUP_TIMEOUT_S, sglang_command, sglang_env

PY = "/opt/venv/bin/python"


def command(
    backend: str,
    host: str = "0.0.0.0",
    tp_size: int = 1,
    nccl_port: int | None = None,
    lora: LoRAConfig | None = None,
    **inference,
) -> list[str]:
    return server_command(
        backend,
        "/models/tiny",
        host,
        30000,
        tp_size=tp_size,
        inference=InferenceConfig(**inference),
        dtype="bfloat16",
        seed=7,
        python=PY,
        nccl_port=nccl_port,
        lora=lora,
    )


def test_sglang_command_with_tensor_parallelism():
    assert command("sglang", tp_size=2, nccl_port=24117, mem_fraction_static=0.7, max_running_requests=64) == [
        PY, "-m", "sglang.launch_server",
        "--model-path", "/models/tiny",
        "--host", "0.0.0.0",
        "--port", "30000",
        "--tp-size", "2",
        "--mem-fraction-static", "0.7",
        "--dtype", "bfloat16",
        "--random-seed", "7",
        "--max-running-requests", "64",
        "--nccl-port", "24117",  # the server worker's, not one SGLang draws at random where another may take it
    ]  # fmt: skip
    assert "--nccl-port" not in command("cpu", nccl_port=24117)  # its ranks meet over pipes


def test_sglang_command_defaults():
    assert sglang_command("/m", "node1", 8000, python=PY) == [
        PY, "-m", "sglang.launch_server", "--model-path", "/m", "--host", "node1", "--port", "8000",
        "--tp-size", "1", "--mem-fraction-static", "0.85", "--dtype", "auto", "--random-seed", "0",
    ]  # fmt: skip
    assert SGLANG_SETUP_TIMEOUT_S == 20 * 60


def test_extra_args_are_appended_verbatim_one_argv_element_each():
    extra = [
        "--max-total-tokens",
        "4096",
        "--json-model-override-args",
        '{"rope_scaling": null}',
        "--log-level=warning",
    ]
    cmd = command("sglang", extra_args=extra)
    assert cmd[-len(extra) :] == extra
    assert cmd.index("--random-seed") < cmd.index("--max-total-tokens")


@pytest.mark.parametrize(
    ("host", "expected"),
    [("::", "::"), ("[::1]", "::1"), ("fe80::1%eth0", "fe80::1%eth0"), ("[2001:db8::5]", "2001:db8::5")],
)
def test_ipv6_bind_hosts_go_without_brackets(host, expected):
    for backend in ("sglang", "cpu"):
        cmd = command(backend, host=host)
        assert cmd[cmd.index("--host") + 1] == expected


@pytest.mark.parametrize("host", ["", "[]", "not:an:address"])
def test_bad_bind_hosts_are_refused(host):
    with pytest.raises(ValueError, match="host"):
        command("sglang", host=host)


@pytest.mark.parametrize(
    ("extra", "managed", "field"),
    [
        (["--port", "9000"], "--port", "cluster.net.port_min"),
        (["--port=9000"], "--port", "cluster.net.port_min"),
        (["--tp", "2"], "--tp-size", "allocation.server.tp_size"),  # argparse takes unique prefixes
        (["--tensor-parallel-size", "2"], "--tp-size", "allocation.server.tp_size"),
        (["--model", "/other"], "--model-path", "model.path"),
        (["--enable-metrics", "--random-seed=3"], "--random-seed", "run.seed"),
        (["--mem-fraction-static", "0.5"], "--mem-fraction-static", "inference.mem_fraction_static"),
        (["--dtype", "half"], "--dtype", "model.dtype"),
        (["--host", "::"], "--host", "cluster.net.bind_host"),
        (["--max-running-requests", "8"], "--max-running-requests", "inference.max_running_requests"),
        (["--nccl-port", "29000"], "--nccl-port", "cluster.net.port_min"),
        (["--nccl-p=29000"], "--nccl-port", "cluster.net.port_min"),
    ],
)
def test_extra_args_repeating_a_flag_hpcrl_sets_are_refused(extra, managed, field):
    with pytest.raises(ValueError, match=r"inference\.extra_args") as info:
        command("sglang", extra_args=extra)
    assert managed in str(info.value) and field in str(info.value)


EAGLE_SIZES = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--dp-size", "2"], r"--dp-size 2 \(data-parallel replicas\).*2 x tp_size GPUs.*allocation\.server\.workers"),
        (["--data-parallel-size=2"], r"--data-parallel-size \(--dp-size\) 2 \(data-parallel replicas\)"),
        (["--dp-size", "2", "--attn-dp-size", "2", "--enable-dp-attention"], r"--dp-size 2 \(data-parallel"),
        (["--pipeline-parallel-size", "2"], r"--pipeline-parallel-size \(--pp-size\) 2 \(pipeline stages\).*ranks"),
        (["--pp-size=4", "--enable-dp-attention"], r"--pp-size 4 \(pipeline stages\)"),
        (["--he"], r"no --he \(--help\): SGLang would print its help and exit"),
        (["-h"], r"no -h \(--help\)"),
        (["--conf", "more.yaml"], r"no --conf \(--config\): hpcrl cannot check the options a config file sets"),
        (["--d", "2"], r"SGLang's launch parser accepts \(ambiguous option: --d could match"),
        (["--context-length", "4k2"], r"argument --context-length: '4k2' is not an integer"),
        (["--speculative-algorithm", "EAGLE"], r"--speculative-num-steps, .*given too: .*max\(topk x steps"),
        (["--speculative-algo=nextn", *EAGLE_SIZES, "--speculative-adaptive"], r"no --speculative-adaptive"),
        (["--json-model-override-args", "[1]"], r"a JSON object after --json-model-override-args, not a list"),
    ],
)
def test_extra_args_that_cannot_work_are_refused_before_launch(extra, why):
    with pytest.raises(ConfigError, match=why) as info:
        command("sglang", extra_args=extra)
    assert info.value.path == "inference.extra_args" and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "extra",
    [
        ["--dp-size", "2", "--enable-dp-attention"],  # attention data parallelism: SGLang's --attn-dp-size 2
        ["--attention-data-parallel-size", "2", "--dp-size", "1"],
        ["--enable-dp-attention"],  # alone: one attention group, nothing changes
        ["--context-len", "8k", "--speculative-algorithm", "EAGLE3", *EAGLE_SIZES],
        ["--speculative-algorithm", "NGRAM"],  # holds no output slots
        ["--enable-metrics", "--an-option-of-a-later-release", "1"],  # SGLang's to judge
    ],
)
def test_extra_args_that_work_are_passed_on_verbatim(extra):
    assert command("sglang", extra_args=extra)[-len(extra) :] == extra


def test_extra_args_that_are_not_separate_argv_elements_are_refused():
    with pytest.raises(ValueError, match=r"inference\.extra_args.*two items"):
        command("sglang", extra_args=["--max-total-tokens 4096"])
    with pytest.raises(ValueError, match=r"inference\.extra_args"):
        command("sglang", extra_args=["--max-total-tokens", 4096])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "auto"])
def test_dtypes_pass_through(dtype):
    cmd = sglang_command("/m", "::", 1, dtype=dtype)
    assert cmd[cmd.index("--dtype") + 1] == dtype


def test_bad_values_are_refused_before_launch():
    with pytest.raises(ValueError, match=r"model\.dtype"):
        sglang_command("/m", "::", 1, dtype="fp8")
    with pytest.raises(ValueError, match="tp_size"):
        sglang_command("/m", "::", 1, tp_size=0)
    with pytest.raises(ValueError, match="port"):
        sglang_command("/m", "::", 70000)


def test_cpu_server_command():
    assert command("cpu", max_running_requests=32, batch_wait_ms=2.5) == [
        PY, "-m", "hpcrl.inference.server",
        "--model-path", "/models/tiny",
        "--host", "0.0.0.0",
        "--port", "30000",
        "--max-running-requests", "32",
        "--batch-wait-ms", "2.5",
        "--dtype", "bfloat16",
        "--seed", "7",
        "--tp-size", "1",
    ]  # fmt: skip


def test_cpu_server_takes_a_tensor_parallel_size_and_not_sglangs_extra_args(caplog):
    cmd = command("cpu", tp_size=2)  # ranks of the weight-update group, as SGLang's TP ranks join it
    assert cmd[cmd.index("--tp-size") + 1] == "2"
    with pytest.raises(ValueError, match="tp_size"):
        command("cpu", tp_size=0)
    with caplog.at_level(logging.WARNING):
        cmd = command("cpu", extra_args=["--enable-metrics"])
    assert "--enable-metrics" not in cmd
    assert caplog.records == [], "the run says it once, on the console (config/applies.py), not in the worker's log"


@pytest.mark.parametrize("backend", ["sglang", "cpu"])
def test_lora_makes_both_backends_serve_adapters_with_sglangs_options(backend):
    cmd = command(backend, lora=LoRAConfig(rank=8), extra_args=["--enable-metrics"] if backend == "sglang" else [])
    start = cmd.index("--enable-lora")
    assert cmd[start:] == [
        "--enable-lora",
        "--max-lora-rank", "8",
        "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "--max-loras-per-batch", "3",  # the current adapter, the previous one during an update, the base model
        *(["--enable-metrics"] if backend == "sglang" else []),
    ]  # fmt: skip
    assert cmd[start + 4 : start + 11] == LORA_TARGETS
    assert cmd[:start] == command(backend, extra_args=[])[:start], "the rest of the command is as without LoRA"
    assert "--enable-lora" not in command(backend, lora=LoRAConfig(rank=0, target_modules=["nothing"]))


@pytest.mark.parametrize("backend", ["sglang", "cpu"])
def test_lora_targets_sglang_does_not_take_are_refused_before_launch(backend):
    with pytest.raises(ConfigError, match=r"--lora-target-modules takes \(q_proj, .*\), not \['c_attn'\]") as info:
        command(backend, lora=LoRAConfig(rank=4, target_modules=["q_proj", "c_attn"]))
    assert info.value.path == "train.lora.target_modules"


@pytest.mark.parametrize("rank", [0, 8])
@pytest.mark.parametrize(
    ("extra", "written", "instead"),
    [
        (["--enable-lora"], "--enable-lora", "set train.lora.rank > 0 instead"),
        (["--max-lora-r", "16"], "--max-lora-r (--max-lora-rank)", "set train.lora.rank instead"),
        (["--lora-target", "q_proj", "v_proj"], "--lora-target (--lora-target-modules)", "train.lora.target_modules"),
        (["--max-loras-per-batch=2"], "--max-loras-per-batch", "hpcrl sizes it for the current adapter"),
        (["--lora-paths", "a=/adapters/a"], "--lora-paths", "would serve no request of the run"),
    ],
)
def test_extra_args_setting_sglangs_lora_options_are_refused_with_lora_on_or_off(rank, extra, written, instead):
    with pytest.raises(ConfigError) as info:
        command("sglang", lora=LoRAConfig(rank=rank), extra_args=["--enable-metrics", *extra])
    message = str(info.value)
    assert info.value.path == "inference.extra_args" and "\n" not in message
    assert f"no {written}: hpcrl passes SGLang's LoRA options itself when train.lora.rank > 0" in message
    assert instead in message


def test_extra_args_tuning_sglangs_lora_serving_are_passed_on():
    extra = ["--lora-backend", "triton", "--max-loaded-loras", "4", "--lora-eviction-policy", "fifo"]
    assert command("sglang", lora=LoRAConfig(rank=8), extra_args=extra)[-len(extra) :] == extra


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match=r"'vllm'.*cpu, sglang"):
        command("vllm")


def test_sglang_env_sets_only_what_is_absent():
    assert sglang_env({"PATH": "/bin"}) == {"PATH": "/bin", "PYTHONUNBUFFERED": "1"}
    base = {"PYTHONUNBUFFERED": "0"}
    assert sglang_env(base) == {"PYTHONUNBUFFERED": "0"}
    assert base == {"PYTHONUNBUFFERED": "0"}  # the input is not changed


def test_sglang_env_keeps_the_warm_up_off_the_proxy():
    env = sglang_env({"http_proxy": "http://proxy:3128", "NO_PROXY": "example.org, .site"}, bind_host="[fd00::7]")
    for name in ("no_proxy", "NO_PROXY"):
        entries = env[name].split(",")
        assert entries[:2] == ["example.org", ".site"]
        assert {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "fd00::7"} <= set(entries)
    assert env["http_proxy"] == "http://proxy:3128"


def test_a_discriminative_reward_models_server_is_started_with_is_embedding():
    from hpcrl.config.schema import InferenceConfig
    from hpcrl.inference.commands import server_command

    for backend in ("cpu", "sglang"):
        common = dict(tp_size=1, inference=InferenceConfig(), dtype="float32", seed=0)
        assert server_command(backend, "/m", "127.0.0.1", 9000, **common, is_embedding=True)[-1] == "--is-embedding"
        assert "--is-embedding" not in server_command(backend, "/m", "127.0.0.1", 9000, **common)
