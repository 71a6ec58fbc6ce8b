"""The controller-to-worker RPC: typed messages, tensors as raw bytes, a bearer token on every request.

- ``wire``: ``encode(msg) -> bytes`` / ``decode(bytes) -> msg`` (frame format in its docstring)
- ``messages``: every request and reply dataclass, in the ``MESSAGES`` registry
- ``auth``: the run's secret token file
- ``server``: ``RpcServer``, one per worker rank; ``client``: ``RpcClient``, fan-out from the controller
"""

from hpcrl.rpc.auth import check, create_token, read_token
from hpcrl.rpc.client import RpcClient
from hpcrl.rpc.errors import (
    AuthError,
    BadRequestError,
    PayloadTooLargeError,
    RemoteError,
    RpcConnectionError,
    RpcError,
    UnknownMethodError,
)
from hpcrl.rpc.messages import MESSAGES, register
from hpcrl.rpc.server import RpcServer
from hpcrl.rpc.wire import DecodeError, EncodeError, decode, encode, encode_parts

__all__ = [
    "MESSAGES",
    "AuthError",
    "BadRequestError",
    "DecodeError",
    "EncodeError",
    "PayloadTooLargeError",
    "RemoteError",
    "RpcClient",
    "RpcConnectionError",
    "RpcError",
    "RpcServer",
    "UnknownMethodError",
    "check",
    "create_token",
    "decode",
    "encode",
    "encode_parts",
    "read_token",
    "register",
]
