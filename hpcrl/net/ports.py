"""Free TCP ports for workers that start at the same moment on the same node.

Asking the kernel for port 0 and advertising the result races: the port is free when probed but any
process may take it before the server binds. Workers launched together instead split one port range
into disjoint per-rank slices (``PortAllocator``), so two ranks can never pick the same port, and each
probes only its own slice. The range sits below the kernel's ephemeral range, which outgoing
connections draw from without asking anyone.
"""

import ipaddress
import logging
import random
import socket

from hpcrl.net.address import MAX_PORT, has_ipv6, is_ipv6

logger = logging.getLogger(__name__)

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# Linux's default; also what other systems get, where the file does not exist.
_DEFAULT_EPHEMERAL = (32768, 60999)
_FIRST_UNPRIVILEGED = 1024
_PORT_LIMIT = 65536  # exclusive upper bound of a port range
_PREFERRED_LOW = 20000  # clear of the common service ports (8000s, 5000s) and below Linux's ephemeral range
_MIN_SPAN = 1000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, both inclusive, as the sysctl writes it."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(field) for field in f.read().split())
    except (OSError, ValueError):
        logger.debug("cannot read %s; assuming %s", _EPHEMERAL_RANGE_FILE, _DEFAULT_EPHEMERAL)
        return _DEFAULT_EPHEMERAL
    return low, high


def default_port_range() -> tuple[int, int]:
    """A range ``[low, high)`` for ``PortAllocator`` that keeps clear of the ephemeral range."""
    eph_low, eph_high = ephemeral_range()
    if eph_low >= _PREFERRED_LOW + _MIN_SPAN:
        return _PREFERRED_LOW, eph_low
    # A tuned sysctl moved the ephemeral range down, leaving under _MIN_SPAN ports above 20000; split
    # across many ranks that is too few, so take every unprivileged port below it instead.
    if eph_low - _FIRST_UNPRIVILEGED >= _MIN_SPAN:
        return _FIRST_UNPRIVILEGED, eph_low
    if _PORT_LIMIT - (eph_high + 1) >= _MIN_SPAN:
        return eph_high + 1, _PORT_LIMIT
    fallback = (_PREFERRED_LOW, _DEFAULT_EPHEMERAL[0])
    logger.warning(
        "ephemeral range %s leaves no room for worker ports; using %s, where outgoing connections may "
        "take a port first. Narrow net.ipv4.ip_local_port_range or pass port_range explicitly",
        (eph_low, eph_high),
        fallback,
    )
    return fallback


def is_port_free(port: int, host: str = "") -> bool:
    """Whether a TCP server could bind ``port`` now, on IPv4 and, where this machine has it, IPv6.

    ``host`` narrows one family's check to that address (an IP literal); the other family still checks
    its wildcard, so a port reported free is usable whichever family the server ends up using.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= MAX_PORT:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
    v4_host, v6_host = "0.0.0.0", "::"
    if is_ipv6(host):
        v6_host = host
    elif host:
        _check_ipv4_literal(host)
        v4_host = host
    if not _can_bind(socket.AF_INET, v4_host, port):
        return False
    if v6_host == "::" and not has_ipv6():
        return True  # nothing can listen on IPv6 here, so nothing can hold the port there
    return _can_bind(socket.AF_INET6, v6_host, port)


class PortAllocator:
    """Hands out ports from rank ``rank``'s slice of ``port_range``, never the same one twice.

    ``[low, high)`` is cut into ``world_size`` equal slices (the remainder stays unused), so workers
    sharing a range and numbered by rank cannot collide. Ports are probed, not held: bind them soon.
    """

    def __init__(
        self,
        port_range: tuple[int, int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        host: str = "",
        start_offset: int | None = None,
    ) -> None:
        low, high = default_port_range() if port_range is None else port_range
        size = _validated_slice_size(low, high, rank, world_size)
        self._slice = (low + rank * size, low + (rank + 1) * size)
        self._rank = rank
        self._world_size = world_size
        self._host = host
        self._handed_out: set[int] = set()
        if start_offset is not None and start_offset < 0:
            raise ValueError(f"start_offset must be >= 0, got {start_offset}; omit it for a random start")
        # Two jobs sharing a node reuse the same ranks and so the same slices; a random start makes them
        # unlikely to probe the same port at once. SystemRandom because training code seeds `random`.
        self._cursor = random.SystemRandom().randrange(size) if start_offset is None else start_offset % size
        _warn_if_ephemeral(low, high)

    @property
    def slice(self) -> tuple[int, int]:
        """This rank's ports, ``[low, high)``."""
        return self._slice

    def allocate(self, count: int = 1) -> list[int]:
        """Return ``count`` ports of this slice that are free now and were not handed out before."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        low, high = self._slice
        size = high - low
        ports: list[int] = []
        for step in range(size):
            port = low + (self._cursor + step) % size
            if port in self._handed_out or not is_port_free(port, self._host):
                continue
            ports.append(port)
            if len(ports) == count:
                self._cursor = (port - low + 1) % size
                self._handed_out.update(ports)
                return ports
        raise RuntimeError(
            f"rank {self._rank} of {self._world_size} found {len(ports)} of {count} requested free ports "
            f"in its slice [{low}, {high}) ({len(self._handed_out)} already handed out, the rest in use); "
            "widen port_range, use fewer ranks per range, or stop what holds those ports"
        )


def _validated_slice_size(low: int, high: int, rank: int, world_size: int) -> int:
    if not _FIRST_UNPRIVILEGED <= low < high <= _PORT_LIMIT:
        raise ValueError(
            f"port_range must satisfy 1024 <= low < high <= 65536, got ({low}, {high}); "
            "high is exclusive, and ports below 1024 need root"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1} (world_size={world_size}), got {rank}")
    size = (high - low) // world_size
    if size < 1:
        raise ValueError(
            f"port_range ({low}, {high}) holds {high - low} ports, fewer than world_size={world_size}; "
            "every rank needs a slice of at least one port, so widen port_range"
        )
    return size


def _warn_if_ephemeral(low: int, high: int) -> None:
    eph_low, eph_high = ephemeral_range()
    if low <= eph_high and high > eph_low:
        logger.warning(
            "port_range [%d, %d) overlaps the ephemeral range %d-%d: any outgoing connection may take "
            "those ports between the probe and the bind. Prefer a range below %d",
            low,
            high,
            eph_low,
            eph_high,
            eph_low,
        )


def _check_ipv4_literal(host: str) -> None:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(
            f"host must be empty (the wildcards) or an IP literal, got {host!r}; resolve names first"
        ) from None


def _can_bind(family: socket.AddressFamily, host: str, port: int) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As servers set it, so a port whose old connections sit in TIME_WAIT counts as free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # The IPv4 check covers IPv4; a dual-stack bind would conflict with IPv4 listeners twice.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
    except OSError:
        return False
    return True
