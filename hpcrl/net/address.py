"""Which address this node advertises to its peers, and how ``host:port`` is written and read.

A worker binds a wildcard (``bind_address``) and advertises one concrete address (``discover_host``)
that the controller dials. They are separate because a wildcard cannot be dialled, and the address
peers should dial is a property of the cluster's network, not of the socket.

Discovery order, each step restricted to the requested family (``auto`` tries IPv4 before IPv6):

1. ``HPCRL_ADVERTISE_HOST``, when set, is returned as is. It is the operator's override for nodes where
   discovery picks the wrong network (a management NIC instead of InfiniBand, a container bridge),
   or where peers should dial a DNS name. It beats every argument, including ``interface``.
2. ``interface``, when given: that NIC's address; a missing NIC or address is an error, not a fallback.
3. This node's hostname resolved by DNS / ``/etc/hosts``, if it is a non-loopback address of this node.
4. The first non-loopback, non-link-local address on an interface that is up.
5. The source address the kernel would use towards a public address (UDP connect; nothing is sent).
6. Loopback, with a warning: only processes on this node can reach it.
"""

import functools
import ipaddress
import logging
import os
import socket
from typing import NoReturn

import psutil

logger = logging.getLogger(__name__)

ADVERTISE_HOST_ENV = "HPCRL_ADVERTISE_HOST"
FAMILIES = ("auto", "ipv4", "ipv6")

_SOCKET_FAMILY = {"ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}
_WILDCARD = {"ipv4": "0.0.0.0", "ipv6": "::"}
_LOOPBACK = {"ipv4": "127.0.0.1", "ipv6": "::1"}
MAX_PORT = 65535
# TEST-NET-1 and the IPv6 documentation prefix are not routed in practice; connect() on a UDP socket
# sends no packet, it only makes the kernel choose the source address of its default route.
_PROBE_TARGET = {"ipv4": ("192.0.2.1", 9), "ipv6": ("2001:db8::1", 9)}
_HOSTPORT_FORM = "expected host:port or [ipv6]:port, e.g. node1:8000, 10.0.0.1:8000 or [::1]:8000"


def discover_host(family: str = "auto", interface: str = "") -> str:
    """Return the address other nodes should use to reach this one (see the module docstring)."""
    families = _families(family)
    override = os.environ.get(ADVERTISE_HOST_ENV, "").strip()
    if override:
        return _checked_override(override, family)
    if interface:
        return _interface_address(interface, families)
    for fam in families:
        host = _hostname_address(fam) or _up_interface_address(fam)
        if host:
            return host
    for fam in families:
        host = _probe_address(fam)
        if host:
            return host
    host = _LOOPBACK[families[0]]
    logger.warning(
        "found no non-loopback %s address on this node; advertising %s, which only processes on this "
        "node can reach. Set %s or pass an interface if workers run on other nodes",
        " or ".join(families),
        host,
        ADVERTISE_HOST_ENV,
    )
    return host


def format_hostport(host: str, port: int) -> str:
    """Write ``host:port``, bracketing IPv6 literals (zone ids stay inside): ``[fe80::1%eth0]:80``."""
    _check_port(port)
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare:
        raise ValueError(f"host must not be empty (got {host!r} with port {port}); pass a name or an IP")
    if is_ipv6(bare):
        return f"[{bare}]:{port}"
    if ":" in bare:
        raise ValueError(f"host {host!r} contains ':' but is not an IPv6 address; pass a name or an IP")
    return f"{bare}:{port}"


def parse_hostport(text: str) -> tuple[str, int]:
    """Read ``host:port`` or ``[ipv6]:port`` back into ``(host, port)``; the host loses its brackets."""
    if not text or any(c.isspace() for c in text):
        _reject(text, "it is empty or contains whitespace")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            _reject(text, "an IPv6 address in brackets must be followed by ':port'")
        if not is_ipv6(host):
            _reject(text, f"{host!r} inside the brackets is not an IPv6 address")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            _reject(text, "the port is missing")
        if ":" in host:
            _reject(text, "an IPv6 address needs brackets, or the port cannot be told apart")
        if not host:
            _reject(text, "the host is empty")
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > MAX_PORT:
        _reject(text, f"port {port_text!r} is not an integer in 0..65535")
    return host, int(port_text)


def is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 literal (zone id allowed, brackets not)."""
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def family_of(host: str) -> str:
    """``"ipv6"`` for an IPv6 literal, else ``"ipv4"`` (a hostname is assumed to resolve to IPv4)."""
    return "ipv6" if is_ipv6(host) else "ipv4"


def bind_address(family: str) -> str:
    """The wildcard a server binds on for ``family``: ``"0.0.0.0"`` or ``"::"``."""
    if family not in _WILDCARD:
        raise ValueError(
            f"bind_address family must be 'ipv4' or 'ipv6', got {family!r}; "
            "pass family_of(advertised_host) so the server listens where peers will dial"
        )
    return _WILDCARD[family]


@functools.cache
def has_ipv6() -> bool:
    """Whether this machine can bind ``::1``; kernels built with IPv6 can still have it disabled."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def _families(family: str) -> tuple[str, ...]:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    return ("ipv4", "ipv6") if family == "auto" else (family,)


def _checked_override(override: str, family: str) -> str:
    host = override[1:-1] if override.startswith("[") and override.endswith("]") else override
    literal_family = family_of(host) if is_ipv6(host) or _is_ipv4(host) else ""
    if family != "auto" and literal_family and literal_family != family:
        raise ValueError(
            f"{ADVERTISE_HOST_ENV}={override!r} is an {literal_family} address but family={family!r} "
            f"was requested; set {ADVERTISE_HOST_ENV} to an {family} address or a hostname, or unset it"
        )
    logger.info("advertising %s from %s", host, ADVERTISE_HOST_ENV)
    return host


def _interface_address(interface: str, families: tuple[str, ...]) -> str:
    nics = psutil.net_if_addrs()
    if interface not in nics:
        raise ValueError(
            f"network interface {interface!r} does not exist on this node; available: "
            f"{', '.join(sorted(nics))}. Pick one of those, or leave interface empty to discover it"
        )
    stats = psutil.net_if_stats().get(interface)
    if stats is not None and not stats.isup:
        logger.warning("network interface %r is down; peers may not reach its address", interface)
    for fam in families:
        addresses = [a.address for a in nics[interface] if a.family == _SOCKET_FAMILY[fam]]
        if addresses:
            # A link-local address works only on the same link and with its zone, so it comes last.
            best = min(addresses, key=lambda a: ipaddress.ip_address(a).is_link_local)
            needs_zone = fam == "ipv6" and ipaddress.ip_address(best).is_link_local and "%" not in best
            return f"{best}%{interface}" if needs_zone else best
    found = [a.address for a in nics[interface] if a.family in _SOCKET_FAMILY.values()]
    raise ValueError(
        f"network interface {interface!r} has no {' or '.join(families)} address (it has: "
        f"{', '.join(found) or 'none'}); choose another interface or family"
    )


def _hostname_address(fam: str) -> str:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, _SOCKET_FAMILY[fam], socket.SOCK_STREAM)
    except OSError:  # an unresolvable hostname is common on compute nodes; fall through
        return ""
    for *_, sockaddr in infos:
        address = str(sockaddr[0])
        # A stale /etc/hosts or DNS entry can name another machine, so the address must be ours.
        if _is_routable(address) and _is_local(fam, address):
            return address
    return ""


def _up_interface_address(fam: str) -> str:
    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if name not in stats or not stats[name].isup:
            continue
        for address in addresses:
            if address.family == _SOCKET_FAMILY[fam] and _is_routable(address.address):
                return str(address.address)
    return ""


def _probe_address(fam: str) -> str:
    try:
        with socket.socket(_SOCKET_FAMILY[fam], socket.SOCK_DGRAM) as sock:
            sock.connect(_PROBE_TARGET[fam])
            address = sock.getsockname()[0]
    except OSError:  # no route for this family
        return ""
    return address if _is_routable(address) else ""


def _is_routable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast)


def _is_local(fam: str, address: str) -> bool:
    try:
        with socket.socket(_SOCKET_FAMILY[fam], socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def _is_ipv4(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False


def _check_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise ValueError(f"port must be an integer in 0..65535, got {port!r}")


def _reject(text: str, reason: str) -> NoReturn:
    raise ValueError(f"cannot parse address {text!r}: {reason}; {_HOSTPORT_FORM}")
