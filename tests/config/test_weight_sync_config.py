"""The config of the weight sync and the servers' SGLang contract: what a run asks for is checked before it starts."""

import pytest

from hpcrl.config import ConfigError
from hpcrl.inference.options import client_options
from tests.config.compose import load


def test_cpu_servers_take_a_tensor_parallel_size():
    cfg = load("allocation.spec=cpu:d2t2+fsdp:d2g0", "train.weight_sync=distributed")
    assert (cfg.allocation.server.tp_size, cfg.allocation.server.gpus_per_worker) == (2, 0)


def test_distributed_sync_from_gpu_trainers_to_cpu_servers_is_refused():
    """The trainers would send over nccl, which the CPU server cannot receive: a hang, refused before the start."""
    with pytest.raises(ConfigError, match=r"train\.weight_sync='distributed'.*nccl.*gloo only"):
        load("cluster.gpus_per_node=8", "allocation.spec=cpu:d1+fsdp:d2", "train.weight_sync=distributed")
    load("cluster.gpus_per_node=8", "allocation.spec=cpu:d1+fsdp:d2", "train.weight_sync=disk")  # disk is fine


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("train.weight_sync_bucket_mb=0", "train.weight_sync_bucket_mb", "MiB >= 1"),
        ("inference.weight_update_timeout_s=0", "inference.weight_update_timeout_s", "seconds > 0"),
        ("inference.context_overflow=cut", "inference.context_overflow", "one of drop, truncate"),
    ],
)
def test_weight_sync_and_context_fields_are_checked(override, field, expected):
    with pytest.raises(ConfigError) as err:
        load(override)
    assert err.value.path == field and expected in str(err.value)


def test_the_client_options_follow_the_config(tiny_model):
    cfg = load(
        "allocation.spec=cpu:d2t2+fsdp:d2g0",
        "model=local",
        f"model.path={tiny_model}",
        "inference.weight_update_timeout_s=900",
        "inference.context_overflow=truncate",
    )
    options = client_options(cfg)
    assert options["tp_size"] == 2 and options["weight_update_timeout_s"] == 900
    assert (options["context_length"], options["context_overflow"]) == (512, "truncate")  # the tiny model's
    sglang = load(
        "allocation.server.backend=sglang", "model=local", f"model.path={tiny_model}", "cluster.gpus_per_node=8"
    )
    sglang.inference.extra_args = ["--context-length", "4096"]  # SGLang's own flag wins over config.json, as there
    assert client_options(sglang)["context_length"] == 4096
    sglang.inference.extra_args = ["--context-len", "3k", "--enable-metrics"]  # read as SGLang's argparse reads it
    assert client_options(sglang)["context_length"] == 3000


SGLANG = ("allocation.server.backend=sglang", "cluster.gpus_per_node=8")


def test_extra_args_that_cannot_work_are_refused_with_the_config():
    """Before anything is submitted: pipeline stages need GPUs a server worker does not own (sglang_args)."""
    with pytest.raises(ConfigError, match=r"--pipeline-parallel-size \(--pp-size\) 2 \(pipeline stages\)") as err:
        load(*SGLANG, "inference.extra_args=[--pipeline-parallel-size,'2']")
    assert err.value.path == "inference.extra_args"
    load("inference.extra_args=[--pipeline-parallel-size,'2']")  # the cpu server ignores them (and warns)
    load(*SGLANG, "inference.extra_args=[--attn-dp-size,'2']")  # attention data parallelism: on the same GPUs
