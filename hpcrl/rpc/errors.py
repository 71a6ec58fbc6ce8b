"""What an RPC call raises on the client side: one class per way a call can fail, all RpcError.

``status`` is the reply's status (``transport.py``); its numbers are HTTP's, for the same meanings.
"""

from __future__ import annotations


class RpcError(Exception):
    """A call to one rank failed. ``others`` holds the errors of other ranks in the same fan-out."""

    def __init__(self, rank: int, address: str, method: str, message: str, status: int | None = None):
        self.rank, self.address, self.method, self.message, self.status = rank, address, method, message, status
        self.others: list[BaseException] = []
        super().__init__(self._text())

    def _text(self) -> str:
        status = f" (status {self.status})" if self.status is not None else ""
        return f"rank {self.rank} at {self.address}: {self.method} failed{status}: {self.message}"


class AuthError(RpcError):
    """401: the server refused the token; the client and server read different run directories?"""


class BadRequestError(RpcError):
    """400: the server could not read or decode the request (the message says why)."""


class UnknownMethodError(RpcError):
    """404: the server has no such method (the message lists the ones it has)."""


class PayloadTooLargeError(RpcError):
    """413: the request is over the server's ``max_body_bytes``."""


class RpcConnectionError(RpcError):
    """No reply: connection refused or reset, or no reply within the timeout. The call may have run."""


class RpcTimeoutError(RpcConnectionError):
    """No reply within the client's ``timeout_s``: the rank may be stalled (a stuck collective, a stopped process).
    ``started``: when the call began (``time.time()``); ``timeout_s``: the deadline it missed."""

    def __init__(self, rank: int, address: str, method: str, started: float, timeout_s: float):
        self.started, self.timeout_s = started, timeout_s
        super().__init__(rank, address, method, f"no reply within {timeout_s} s")


class RemoteError(RpcError):
    """500: the handler raised; ``error_type``, ``message`` and ``traceback`` are the remote exception's."""

    def __init__(self, rank: int, address: str, method: str, error_type: str, message: str, traceback: str):
        self.error_type, self.traceback = error_type, traceback
        super().__init__(rank, address, method, message, 500)

    def _text(self) -> str:
        head = f"rank {self.rank} at {self.address}: {self.method} raised {self.error_type}: {self.message}"
        return f"{head}\n--- remote traceback (rank {self.rank}) ---\n{self.traceback.rstrip()}"


BY_STATUS: dict[int, type[RpcError]] = {
    400: BadRequestError,
    401: AuthError,
    404: UnknownMethodError,
    413: PayloadTooLargeError,
}
