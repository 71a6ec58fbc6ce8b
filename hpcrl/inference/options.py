"""The ``InferenceClient`` settings of a run, from its config: the controller's client and each rollout
worker's are the same (deadlines, the servers' tensor-parallel size, the context check)."""

from __future__ import annotations

from typing import Any

from hpcrl.config.schema import Config
from hpcrl.inference.sglang_args import served_context

POLICY_ADAPTER = "policy"  # with train.lora: the name the servers hold the policy's adapter under (adapter_sync.py)


def client_options(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of ``InferenceClient`` (all but the addresses) for the run of ``cfg``; ``cfg.model.path``
    must name the model the servers load (the run's config.yaml does)."""
    server = cfg.allocation.server
    extra_args = cfg.inference.extra_args if server.backend == "sglang" else ()  # the cpu server ignores them
    return {
        "request_timeout_s": cfg.rollout.request_timeout_s,
        "no_server_timeout_s": cfg.cluster.server_wait_s(),  # how long a request waits for a restarting server
        "tp_size": server.tp_size,
        "weight_update_timeout_s": cfg.inference.weight_update_timeout_s,
        "context_length": served_context(cfg.model.path, extra_args),
        "context_overflow": cfg.inference.context_overflow,
        # every generate request names the policy's adapter; evaluation only (run.max_steps=0) serves model.path
        "adapter": POLICY_ADAPTER if cfg.train.lora.rank and cfg.run.max_steps else None,
        "min_servers": server.min_workers or 1,  # an elastic fleet waits below allocation.server.min_workers
    }
