"""The command line of one inference server, for each server backend (``allocation.server.backend``).

Both backends speak SGLang's HTTP API; the scheduler runs the argv returned here without a shell. With LoRA
(``train.lora.rank`` > 0) both get SGLang's LoRA options (``sglang.lora_args``), under SGLang's names. A
discriminative reward model (``reward.model.kind``) is served with ``--is-embedding`` on both, as SGLang serves one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from hpcrl.config.schema import SERVER_BACKENDS, InferenceConfig, LoRAConfig
from hpcrl.inference.sglang import bind_host_arg, lora_args, port_arg, sglang_command


def server_command(
    backend: str,
    model_path: str | Path,
    host: str,
    port: int,
    *,
    tp_size: int,
    inference: InferenceConfig,
    dtype: str,
    seed: int,
    python: str = sys.executable,
    nccl_port: int | None = None,
    lora: LoRAConfig | None = None,
    is_embedding: bool = False,
) -> list[str]:
    """The argv that starts one server of ``backend`` bound to ``host:port``; ``nccl_port`` is where SGLang's
    ranks meet (``sglang_command``), which the CPU server does not have; ``lora`` (``train.lora``) with a rank
    above 0 makes it serve adapters (None: none); ``is_embedding``: a discriminative reward model's server
    (``--is-embedding``: its score head's route, no generation)."""
    build = _BUILDERS.get(backend)
    if build is None:
        raise ValueError(
            f"unknown server backend {backend!r}: expected one of {', '.join(SERVER_BACKENDS)} "
            "(allocation.server.backend)"
        )
    lora = lora or LoRAConfig()
    cmd = build(str(model_path), host, port, tp_size, inference, dtype, seed, python, nccl_port, lora)
    return [*cmd, "--is-embedding"] if is_embedding else cmd


def _sglang(
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    inf: InferenceConfig,
    dtype: str,
    seed: int,
    python: str,
    nccl_port: int | None,
    lora: LoRAConfig,
) -> list[str]:
    return sglang_command(
        model_path,
        host,
        port,
        tp_size=tp_size,
        mem_fraction_static=inf.mem_fraction_static,
        dtype=dtype,
        seed=seed,
        extra_args=inf.extra_args,
        python=python,
        max_running_requests=inf.max_running_requests,
        nccl_port=nccl_port,
        lora_rank=lora.rank,
        lora_target_modules=lora.target_modules,
    )


def _cpu(
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    inf: InferenceConfig,
    dtype: str,
    seed: int,
    python: str,
    nccl_port: int | None,  # unused: its ranks are child processes it talks to over pipes, with no TCP store
    lora: LoRAConfig,
) -> list[str]:
    if tp_size < 1:
        raise ValueError(f"allocation.server.tp_size must be >= 1, got {tp_size}")
    # inference.extra_args and mem_fraction_static are SGLang's: the run names them (config/applies.py)
    return [
        python,
        "-m",
        "hpcrl.inference.server",
        "--model-path",
        model_path,
        "--host",
        bind_host_arg(host),
        "--port",
        port_arg(port),
        "--max-running-requests",
        str(inf.max_running_requests),
        "--batch-wait-ms",
        repr(float(inf.batch_wait_ms)),
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--tp-size",  # ranks that join the weight-update group, as SGLang's would (generation stays on one)
        str(tp_size),
        *lora_args(lora.rank, lora.target_modules),  # SGLang's options, names and checks: it serves as SGLang does
    ]


_Builder = Callable[[str, str, int, int, InferenceConfig, str, int, str, int | None, LoRAConfig], list[str]]
_BUILDERS: dict[str, _Builder] = {
    "sglang": _sglang,
    "cpu": _cpu,
}
