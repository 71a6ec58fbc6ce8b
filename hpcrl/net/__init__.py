"""Addresses and ports: what a worker advertises as ``host:port`` and which port it listens on."""

from hpcrl.net.address import (
    ADVERTISE_HOST_ENV,
    bind_address,
    discover_host,
    family_of,
    format_hostport,
    has_ipv6,
    is_ipv6,
    parse_hostport,
)
from hpcrl.net.ports import PortAllocator, default_port_range, ephemeral_range, is_port_free

__all__ = [
    "ADVERTISE_HOST_ENV",
    "PortAllocator",
    "bind_address",
    "default_port_range",
    "discover_host",
    "ephemeral_range",
    "family_of",
    "format_hostport",
    "has_ipv6",
    "is_ipv6",
    "is_port_free",
    "parse_hostport",
]
