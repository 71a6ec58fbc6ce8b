"""``python -m hpcrl.inference.server --model-path DIR --host H --port N [...]``."""

from __future__ import annotations

import argparse
import logging
import os

from hpcrl.logs import setup_logging

log = logging.getLogger("hpcrl.inference.server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcrl.inference.server", description=__doc__)
    p.add_argument("--model-path", required=True, help="local Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (a wildcard or one interface)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-running-requests", type=int, default=256, help="the most sequences decoded together")
    p.add_argument("--batch-wait-ms", type=float, default=2.0, help="how long a request waits for batch mates")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--weight-version", default="default", help="weight_version reported until the first update")
    p.add_argument("--rank", default=os.environ.get("HPCRL_RANK", "0"), help="worker rank, for log lines")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("server", args.rank)
    from aiohttp import web

    from hpcrl.inference.server.app import Server
    from hpcrl.inference.server.runner import ModelRunner
    from hpcrl.inference.server.scheduler import Scheduler

    runner = ModelRunner(args.model_path, args.dtype, args.seed)
    scheduler = Scheduler(runner, args.max_running_requests, args.batch_wait_ms)
    scheduler.weight_version = args.weight_version
    log.info("serving %s on %s port %d", args.model_path, args.host, args.port)
    web.run_app(Server(runner, scheduler).app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
