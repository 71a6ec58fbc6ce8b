"""The controller-to-worker RPC: typed messages, tensors as raw bytes, the run's token on every connection.

- ``wire``: ``encode(msg) -> bytes`` / ``decode(bytes) -> msg`` (frame format in its docstring)
- ``messages``: every request and reply dataclass, in the ``MESSAGES`` registry
- ``auth``: the run's secret token file
- ``server``: ``RpcServer``, one per worker rank; ``client``: ``RpcClient``, fan-out from the controller
- ``transport``, ``connection``: hpcrl's own framing on long-lived TCP connections (not HTTP)

The names below load their module on first use: ``hpcrl.rpc.auth`` alone imports no torch, which the
processes that only speak HTTP (server workers, the lease endpoint) should not pay for.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "check": "auth",
    "create_token": "auth",
    "read_token": "auth",
    "RpcClient": "client",
    "AuthError": "errors",
    "BadRequestError": "errors",
    "PayloadTooLargeError": "errors",
    "RemoteError": "errors",
    "RpcConnectionError": "errors",
    "RpcError": "errors",
    "RpcTimeoutError": "errors",
    "UnknownMethodError": "errors",
    "MESSAGES": "messages",
    "register": "messages",
    "RpcServer": "server",
    "DecodeError": "wire",
    "EncodeError": "wire",
    "decode": "wire",
    "encode": "wire",
    "encode_parts": "wire",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hpcrl.rpc' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hpcrl.rpc.{_WHERE[name]}"), name)
