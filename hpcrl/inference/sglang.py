"""The SGLang server launch: its command line and the environment it gets on a cluster.

``sglang_command`` builds ``python -m sglang.launch_server ...`` as an argv list, with ``inference.extra_args``
appended once ``sglang_args.launch_args`` has read them as SGLang will (abbreviations included) and found nothing
that cannot work: a flag hpcrl sets itself, data-parallel replicas or pipeline stages, and the rest listed there.
With LoRA (``train.lora.rank`` > 0) the server is started ready for adapters (``lora_args``), which the client
then loads by name.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcrl.config.errors import ConfigError
from hpcrl.inference.sglang_args import launch_args
from hpcrl.inference.sglang_flags import LORA_TARGET_MODULES
from hpcrl.net import is_ipv6

# Model loading on big clusters can take well over 5 minutes (weights from a shared filesystem,
# CUDA graph capture), so a server gets 20 minutes to become healthy.
SGLANG_SETUP_TIMEOUT_S = 1200

DTYPES = ("auto", "float32", "bfloat16", "float16")  # same names in hpcrl's config and SGLang's --dtype

# Adapters one running batch may mix (SGLang's --max-loras-per-batch; each is a GPU buffer of --max-lora-rank over
# the target modules): the current policy's adapter; during an update, the previous one, still named by requests
# that started before it (SGLang unloads an adapter only once its requests end); and the base model, which takes a
# slot of its own when a batch holds a request naming no adapter (SGLang's /health generates one).
MAX_LORAS_PER_BATCH = 3

_PROXY_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
# Addresses SGLang's start-up warm-up may dial: it requests its own --host, a wildcard included.
_LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")


def sglang_command(
    model_path: str | Path,
    host: str,
    port: int,
    tp_size: int = 1,
    mem_fraction_static: float = 0.85,
    dtype: str = "auto",
    seed: int = 0,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    *,
    max_running_requests: int | None = None,
    nccl_port: int | None = None,
    lora_rank: int = 0,
    lora_target_modules: Sequence[str] = (),
) -> list[str]:
    """The argv that starts one SGLang server; ``extra_args`` are appended verbatim, one item per argv element.
    ``lora_rank`` > 0: ready for adapters of that rank on ``lora_target_modules`` (``lora_args``).

    ``nccl_port`` is where SGLang's ranks meet (the TCP store of its torch.distributed setup, on ``host``): a
    port of the server worker's own port slot. Without it SGLang draws one at random, in 22000-29999, where a
    port hpcrl gave another worker on the node may be taken first.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size} (allocation.server.tp_size)")
    if not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)} (model.dtype)")
    cmd = [python, "-m", "sglang.launch_server"]
    cmd += ["--model-path", str(model_path), "--host", bind_host_arg(host), "--port", port_arg(port)]
    cmd += ["--tp-size", str(tp_size), "--mem-fraction-static", repr(float(mem_fraction_static))]
    cmd += ["--dtype", dtype, "--random-seed", str(seed)]
    if max_running_requests is not None:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if nccl_port is not None:
        cmd += ["--nccl-port", port_arg(nccl_port)]
    cmd += lora_args(lora_rank, lora_target_modules)
    launch_args(extra_args)
    return cmd + list(extra_args)


def lora_args(rank: int, target_modules: Sequence[str]) -> list[str]:
    """SGLang's options for serving LoRA adapters of ``rank`` (0: none, no options) on ``target_modules`` (names
    its --lora-target-modules takes, else ConfigError on train.lora.target_modules), loaded while it runs: no
    adapter at start, hence the rank and the modules, which size its adapter buffers."""
    if rank == 0:
        return []
    unknown = [name for name in target_modules if name not in LORA_TARGET_MODULES]
    if unknown or not target_modules:
        expected = f"module names SGLang's --lora-target-modules takes ({', '.join(LORA_TARGET_MODULES)})"
        raise ConfigError("train.lora.target_modules", list(target_modules), f"{expected}, not {unknown or 'none'}")
    cmd = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *target_modules]
    return [*cmd, "--max-loras-per-batch", str(MAX_LORAS_PER_BATCH)]


def sglang_env(base_env: Mapping[str, str], bind_host: str = "") -> dict[str, str]:
    """The environment for an SGLang server: ``base_env`` plus the variables below.

    ``base_env`` should be the whole environment the server will see (``os.environ`` with the
    cluster and role ``env`` applied), since each variable is judged against it.

    - ``PYTHONUNBUFFERED=1`` unless set: the server's stdout is a log file, which Python would
      block-buffer, so the last lines before a crash (what ``ChildExited`` shows) could be lost.
    - ``no_proxy`` / ``NO_PROXY`` extended with loopback, the wildcards and ``bind_host`` when an
      HTTP proxy variable is set (common on clusters, for downloads): SGLang's start-up warm-up
      requests its own ``--host`` with an HTTP client that honours proxy variables, and through a
      proxy it gets an error and the server aborts (sgl-project/sglang issues #2193, #4935, #9814).
      Both spellings get the union of their entries, so neither hides the other.
    """
    env = dict(base_env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if any(env.get(name) for name in _PROXY_VARS):
        entries: list[str] = []
        for value in (env.get("no_proxy", ""), env.get("NO_PROXY", "")):
            entries += [e.strip() for e in value.split(",") if e.strip()]
        extra = [*_LOCAL_ADDRESSES, bind_host_arg(bind_host)] if bind_host else list(_LOCAL_ADDRESSES)
        merged = ",".join(dict.fromkeys(entries + extra))
        env["no_proxy"] = env["NO_PROXY"] = merged
    return env


def bind_host_arg(host: str) -> str:
    """``host`` as a server's ``--host`` wants it: a bind address, so IPv6 without brackets."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare:
        raise ValueError("the server's bind host is empty; pass an address such as 0.0.0.0 or :: (cluster.net)")
    if ":" in bare and not is_ipv6(bare):
        raise ValueError(f"bind host {host!r} contains ':' but is not an IPv6 address; pass a name or an IP")
    return bare


def port_arg(port: int) -> str:
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"server port must be an integer in 1..65535, got {port!r}")
    return str(port)
