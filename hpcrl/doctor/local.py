"""Checks that need only this machine: the run root, the advertised address, the port range, setup timeouts.

    run root        mkdir -p run.root, then write, read back and delete a small file in it
    address         cluster.net -> the address workers advertise (hpcrl.net discovery) and the one they bind
    ports           the port range (cluster.net.port_min..port_max, or the default) against the kernel's
                    ephemeral range, its slices (one per listener of the run), and which of its ports are free
    setup timeout   the model's size on disk -> an estimate of its load time -> cluster.roles.<role>.setup_timeout_s
                    of each role that loads it: server, trainer, and the critic when the run has one; the
                    reward model's size (reward.model.path) -> cluster.roles.reward_model.setup_timeout_s (else
                    the servers'), when the run has reward-model servers

What this machine sees is only half of it on Slurm: ``nodes.py`` repeats the run-root and address checks
from a compute node.
"""

from __future__ import annotations

import ipaddress
import math
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

from hpcrl.config.schema import Config
from hpcrl.doctor.report import Result, fail, ok, warn
from hpcrl.launch.addresses import port_range, worker_addresses
from hpcrl.launch.base import RoleSpec
from hpcrl.launch.slots import PortSlots
from hpcrl.net import default_port_range, ephemeral_range, family_of, has_ipv6, is_ipv6, is_port_free

# A conservative read rate for model weights: a shared filesystem while every worker of the run reads at once
LOAD_GB_PER_S = 0.5
# Start-up besides reading weights: imports, CUDA and NCCL initialisation, SGLang's CUDA graph capture
STARTUP_S = 120.0
MARGIN = 1.5  # a timeout below MARGIN x the estimate leaves too little slack on a busy day: warn
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MODEL_ROLES = ("server", "trainer", "critic")  # the roles that load the model (the critic: its backbone)


def local_checks(cfg: Config) -> Iterator[Result]:
    yield check_run_root(cfg)
    yield check_address(cfg)
    yield check_ports(cfg)
    yield from check_setup_timeouts(cfg)
    yield from check_reward_model_timeout(cfg)


def run_root(cfg: Config) -> Path:
    """run.root as the run will use it (``RunDir.create``: expanded and absolute)."""
    return Path(cfg.run.root).expanduser().absolute()


def check_run_root(cfg: Config) -> Result:
    root = run_root(cfg)
    probe = root / f".hpcrl-doctor-{secrets.token_hex(4)}"
    text = secrets.token_hex(8)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text(text)
        read = probe.read_text()
        probe.unlink()
    except OSError as e:
        return fail("run root", f"cannot write {root}: {e}", "set run.root=DIR to a directory you can write")
    if read != text:
        return fail("run root", f"{probe} read back other text than was written", "check the filesystem of run.root")
    return ok("run root", f"{root} is writable")


def check_address(cfg: Config) -> Result:
    net = cfg.cluster.net
    try:
        advertised, bind = worker_addresses(net)
    except ValueError as e:  # a missing interface, or HPCRL_ADVERTISE_HOST of the wrong family
        advice = "fix cluster.net.interface or cluster.net.family, or set cluster.net.advertise_host"
        return fail("address", str(e), advice)
    family = family_of(advertised)
    found = f"workers advertise {advertised} ({family}) and bind {bind}"
    if net.family == "ipv6" and not has_ipv6():
        return fail("address", "cluster.net.family=ipv6, but this machine cannot bind ::1", "use family auto or ipv4")
    if net.family != "auto" and family != net.family and _is_literal(advertised):
        advice = f"set cluster.net.advertise_host to an {net.family} address"
        return fail("address", f"{found}, not {net.family}", advice)
    if cfg.cluster.kind == "slurm" and _is_loopback(advertised):
        return fail(
            "address",
            f"{found}: a loopback address, which no other node can reach",
            "set cluster.net.interface to the NIC the nodes share (e.g. ib0), or cluster.net.advertise_host",
        )
    if _is_literal(advertised) and not _can_bind(advertised):
        return warn(
            "address",
            f"{found}, but {advertised} is not an address of this machine",
            "fine behind NAT; otherwise leave cluster.net.advertise_host empty to discover this machine's address",
        )
    return ok("address", found)


def check_ports(cfg: Config) -> Result:
    net = cfg.cluster.net
    configured = port_range(net)
    low, high = configured or default_port_range()
    what = (
        f"cluster.net.port_min..port_max [{low}, {high})" if configured else f"the default port range [{low}, {high})"
    )
    eph_low, eph_high = ephemeral_range()
    if low <= eph_high and high > eph_low:
        default_low, default_high = default_port_range()
        return fail(
            "ports",
            f"{what} overlaps the kernel's ephemeral range {eph_low}-{eph_high} "
            "(/proc/sys/net/ipv4/ip_local_port_range), where outgoing connections take ports unasked",
            f"choose a range outside it, e.g. cluster.net.port_min={default_low} cluster.net.port_max={default_high}"
            " (or 0 and 0: that default)",
        )
    listeners = _listeners(cfg)
    size = (high - low) // listeners
    if size < 1:
        return fail("ports", f"{what} has {high - low} ports for {listeners} listeners", "widen the range")
    free = {port for port in range(low, low + size * listeners) if is_port_free(port)}
    families = "IPv4 and IPv6" if has_ipv6() else "IPv4 (this machine has no IPv6)"
    found = f"{what}: {len(free)} of {size * listeners} ports free on {families}, {listeners} slices of {size}"
    full = [k for k in range(listeners) if not free & set(range(low + k * size, low + (k + 1) * size))]
    if full:
        slices = ", ".join(f"[{low + k * size}, {low + (k + 1) * size})" for k in full)
        return fail("ports", f"{found}; no free port in slice {slices}", "stop what holds them, or move the range")
    return ok("ports", found + " (below the ephemeral range)")


def check_setup_timeouts(cfg: Config) -> Iterator[Result]:
    model_specs = [spec for spec in run_specs(cfg) if spec.role in MODEL_ROLES]
    if cfg.model.source == "tiny":
        timeouts = ", ".join(f"{spec.role} {spec.setup_timeout_s:g} s" for spec in model_specs)
        yield ok("setup timeout", f"model.source=tiny loads in seconds; any timeout covers it ({timeouts})")
        return
    size_gb = model_size_gb(Path(cfg.model.path))
    if size_gb is None:
        yield warn(
            "setup timeout",
            f"cannot size the model: model.path={cfg.model.path} has no weight files on this machine",
            "check that the path is right and on a filesystem the nodes see",
        )
        return
    needed_s = STARTUP_S + size_gb / LOAD_GB_PER_S
    for spec in model_specs:
        yield _check_role_timeout(spec.role, spec.setup_timeout_s, size_gb, needed_s)


def check_reward_model_timeout(cfg: Config) -> Iterator[Result]:
    """The reward model's servers (role ``reward_model``) load ``reward.model.path``: its weights on disk, and its
    setup timeout against their load time; nothing without reward-model servers."""
    spec = next((spec for spec in run_specs(cfg) if spec.role == "reward_model"), None)
    if spec is None:
        return
    path = cfg.reward.model.path
    size_gb = model_size_gb(Path(path).expanduser())
    if size_gb is None:
        yield fail(
            "setup timeout reward_model",
            f"reward.model.path={path} has no weight files on this machine: its servers cannot load it",
            "point it at the reward model's directory (Hugging Face layout), on a filesystem the nodes see",
        )
        return
    needed_s = STARTUP_S + size_gb / LOAD_GB_PER_S
    yield _check_role_timeout(spec.role, spec.setup_timeout_s, size_gb, needed_s, "the reward model")


def model_size_gb(path: Path) -> float | None:
    """The size of the weight files in ``path`` (GB, 1e9 bytes); None when there are none."""
    if not path.is_dir():
        return None
    sizes = [f.stat().st_size for f in path.rglob("*") if f.is_file() and f.suffix in WEIGHT_SUFFIXES]
    return sum(sizes) / 1e9 if sizes else None


def _check_role_timeout(
    role: str, timeout_s: float, size_gb: float, needed_s: float, model: str = "the model"
) -> Result:
    check = f"setup timeout {role}"
    key = f"cluster.roles.{role}.setup_timeout_s"
    estimate = (
        f"{model} ({size_gb:.3g} GB) takes about {needed_s:.0f} s to load "
        f"({size_gb:.3g} GB at {LOAD_GB_PER_S:g} GB/s + {STARTUP_S:.0f} s start-up)"
    )
    advice = f"raise it: {key}={math.ceil(needed_s * MARGIN / 10) * 10}"
    if timeout_s < needed_s:
        return fail(check, f"{key}={timeout_s:g} s, but {estimate}", advice)
    if timeout_s < MARGIN * needed_s:
        return warn(check, f"{key}={timeout_s:g} s leaves little slack: {estimate}", advice)
    return ok(check, f"{key}={timeout_s:g} s covers it: {estimate}")


def run_specs(cfg: Config) -> list[RoleSpec]:
    """The roles the run starts, as it starts them (``hpcrl/controller/roles.py``): the critic only when it has
    workers, and each role's setup timeout as the run takes it."""
    from hpcrl.controller.roles import role_specs

    return role_specs(cfg)


def _listeners(cfg: Config) -> int:
    """The port range's slices, as the run's ``PortSlots`` cuts it: the controller's, one per worker of every
    role, and a rendezvous slot for each torchrun role (the trainer's, the critic's)."""
    specs = run_specs(cfg)
    return PortSlots({s.role: s.workers for s in specs}, rendezvous=[s.role for s in specs if s.torchrun]).world


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (an IPv6 zone id dropped), or None for a name."""
    try:
        return ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return None


def _is_literal(host: str) -> bool:
    return _ip(host) is not None


def _is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" or (ip is not None and ip.is_loopback)


def _can_bind(host: str) -> bool:
    family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True
