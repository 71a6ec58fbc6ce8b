"""Where a worker listens and what it tells the controller, from ``cluster.net``."""

from __future__ import annotations

from hpcrl.config.schema import NetConfig
from hpcrl.net import bind_address, discover_host, family_of


def worker_addresses(net: NetConfig) -> tuple[str, str]:
    """(advertised host, bind host): the address peers dial, and the one the listener binds.

    Advertised: ``cluster.net.advertise_host``, else discovered on ``interface`` / by ``family``. Bound:
    ``cluster.net.bind_host``, else the wildcard of the advertised address's family.
    """
    advertised = net.advertise_host or discover_host(net.family, net.interface)
    return advertised, net.bind_host or bind_address(family_of(advertised))


def port_range(net: NetConfig) -> tuple[int, int] | None:
    """cluster.net's port range, or None for the default one (port_min = port_max = 0)."""
    return (net.port_min, net.port_max) if net.port_max else None
