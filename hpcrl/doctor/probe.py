"""What the doctor's probe jobs run on a compute node: ``python -m hpcrl.doctor.probe connect|gpu ...``.

    connect HOST PORT TOKEN --net JSON   the two directions a run uses, with a deadline on each:
        1. listen as a worker would: the address cluster.net makes it advertise, a port from the range
        2. node -> controller: connect to HOST:PORT, send {"token", "node", "address": where it listens}
        3. controller -> node: accept the doctor's connection, read the token back, answer "ok"
        exit 0 when both worked; otherwise print what failed and exit 1
    gpu   prints one line ``HPCRL-PROBE {json}``: nvidia-smi -L, torch's CUDA devices, import sglang (a tested
          release serving the endpoints hpcrl calls; where it does not import, whether it can be installed here);
          each {"ok": bool, "detail": text, "advice": text when the doctor's own would not fit}; every part
          runs, whatever the others gave

A line protocol of JSON text: the doctor and the probe may run different Python versions, and pickle is
never used on a wire in hpcrl.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from typing import Any

from hpcrl.config.schema import NetConfig
from hpcrl.launch.addresses import port_range, worker_addresses
from hpcrl.net import PortAllocator, format_hostport, is_ipv6

MARKER = "HPCRL-PROBE "  # starts the line the doctor reads from a probe's output
TIMEOUT_S = 30.0  # the longest each network step (connect, accept, read) may take
NVIDIA_SMI_TIMEOUT_S = 60.0


def node_name() -> str:
    """Slurm's name of this node (several virtual nodes may share one host name), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def listen(net: NetConfig) -> tuple[socket.socket, str]:
    """A listening socket where a worker with ``net`` would listen, and the ``host:port`` it advertises."""
    advertised, bind = worker_addresses(net)
    port = PortAllocator(port_range(net)).allocate(1)[0]
    family = socket.AF_INET6 if is_ipv6(bind) else socket.AF_INET
    server = socket.create_server((bind, port), family=family)
    return server, format_hostport(advertised, port)


def send_line(conn: socket.socket, message: Any) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def read_line(conn: socket.socket, limit: int = 4096) -> Any:
    """One JSON line from ``conn`` (under the socket's own timeout); ValueError for anything else."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(limit)
        if not chunk or len(data) > limit:
            raise ValueError(f"expected one JSON line, got {data[:200]!r}")
        data += chunk
    return json.loads(data)


def connect(host: str, port: int, token: str, net: NetConfig) -> None:
    """Both directions, or RuntimeError naming the one that failed."""
    server, address = listen(net)
    controller = format_hostport(host, port)
    with server:
        server.settimeout(TIMEOUT_S)
        try:
            with socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
                send_line(conn, {"token": token, "node": node_name(), "address": address})
        except OSError as e:
            raise RuntimeError(f"cannot reach the controller at {controller}: {e}") from e
        print(f"reached the controller at {controller}; listening at {address}", flush=True)
        try:
            peer, _ = server.accept()
        except TimeoutError as e:
            raise RuntimeError(f"the controller did not connect to {address} within {TIMEOUT_S:g} s") from e
        with peer:
            peer.settimeout(TIMEOUT_S)
            if read_line(peer) != {"token": token}:
                raise RuntimeError(f"a connection to {address} did not bring the doctor's token")
            send_line(peer, {"ok": True})
    print(f"the controller reached this node at {address}", flush=True)


def gpu_report() -> dict[str, Any]:
    """{"node": host name, part: {"ok": bool, "detail": text} for each of GPU_PARTS}."""
    return {"node": node_name(), **{part: check() for part, check in GPU_PARTS.items()}}


def _nvidia_smi() -> dict[str, Any]:
    try:
        result = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "detail": f"cannot run nvidia-smi: {e}"}
    lines = (result.stdout.strip() or result.stderr.strip()).splitlines()
    return {"ok": result.returncode == 0, "detail": "; ".join(lines[:8])}


def _torch_cuda() -> dict[str, Any]:
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:  # a broken CUDA install raises all sorts of errors: report it, whatever it is
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}
    detail = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {count} devices"
    if count:
        detail += f" ({torch.cuda.get_device_name(0)})"
    return {"ok": count > 0, "detail": detail}


def _sglang() -> dict[str, Any]:
    from hpcrl.doctor.sglang import install_problems, install_status, sglang_status

    try:
        import sglang  # noqa: F401 (that it imports is the check)
    except Exception as e:  # ImportError, or whatever its CUDA extensions raise on import
        # where the tested release cannot be installed at all, that is what to say, not the ImportError
        return install_status(install_problems()) or {"ok": False, "detail": f"{type(e).__name__}: {e}"}

    return sglang_status()  # the tested version range, and every endpoint hpcrl calls


GPU_PARTS = {"nvidia-smi": _nvidia_smi, "torch": _torch_cuda, "sglang": _sglang}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.doctor.probe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    net = sub.add_parser("connect", help="node -> controller and controller -> node, with deadlines")
    net.add_argument("host")
    net.add_argument("port", type=int)
    net.add_argument("token")
    net.add_argument("--net", default="{}", help="cluster.net as JSON")
    sub.add_parser("gpu", help="nvidia-smi, torch CUDA, import sglang")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.probe == "gpu":
        print(MARKER + json.dumps(gpu_report()), flush=True)
        return
    try:
        connect(args.host, args.port, args.token, NetConfig(**json.loads(args.net)))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"hpcrl doctor probe on {node_name()}: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
