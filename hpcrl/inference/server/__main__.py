"""``python -m hpcrl.inference.server --model-path DIR --host H --port N [...]``."""

from __future__ import annotations

import argparse
import logging
import os

from hpcrl.cores import usable_cores
from hpcrl.errors import UserError, exit_on_user_error
from hpcrl.inference.openai.chat import TOOL_PARSERS, resolve_template
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
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch's intra-op threads for the model; 0 = this process's cores less one (the HTTP loop's), at least 1",
    )
    p.add_argument("--weight-version", default="default", help="weight_version reported until the first update")
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks that join the weight-update group (1 + N-1 children)",
    )
    p.add_argument("--context-length", type=int, default=0, help="prompt + new tokens at most; 0 = the model's")
    p.add_argument(
        "--allow-auto-truncate", action="store_true", help="cut requests over the context length instead of a 400"
    )
    p.add_argument("--chat-template", default="", help="the OpenAI chat routes' template: a .jinja file or tiny_tools")
    p.add_argument(
        "--tool-call-parser", default="none", choices=TOOL_PARSERS, help="how chat answers' tool calls are read"
    )
    p.add_argument("--served-model-name", default="", help="the model's name on /v1 routes; default: the model path")
    p.add_argument("--rank", default=os.environ.get("HPCRL_RANK", "0"), help="worker rank, for log lines")
    args = p.parse_args(argv)
    if args.tp_size < 1:
        p.error(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.torch_threads < 0:
        p.error(f"--torch-threads must be >= 0 (0 = cores less one), got {args.torch_threads}")
    if args.context_length < 0:
        p.error(f"--context-length must be >= 0, got {args.context_length}")
    try:
        resolve_template(args.chat_template)
    except ValueError as e:
        p.error(f"--chat-template: {e}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("server", args.rank)
    try:
        serve(args)
    except UserError as e:  # a model directory that is not there, or whose tokenizer does not load: one line, exit 2
        exit_on_user_error(e)


def serve(args: argparse.Namespace) -> None:
    if not os.path.isdir(args.model_path):
        raise UserError(
            f"--model-path {args.model_path} is not a directory",
            "give a local Hugging Face model directory (config.json, tokenizer files, *.safetensors), e.g. a run's "
            "RUN_DIR/final; nothing is downloaded",
        )
    from aiohttp import web

    from hpcrl.gc_freeze import freeze_startup_heap
    from hpcrl.inference.context import context_length
    from hpcrl.inference.openai.chat import ChatFormat
    from hpcrl.inference.server.app import Server
    from hpcrl.inference.server.runner import ModelRunner
    from hpcrl.inference.server.scheduler import Scheduler
    from hpcrl.inference.server.tp_ranks import TpRanks
    from hpcrl.inference.server.weights import WeightUpdates

    tp = TpRanks(args.tp_size)  # first: the children import torch while this process loads the model
    threads = set_torch_threads(args.torch_threads)
    runner = ModelRunner(args.model_path, args.dtype, args.seed)
    scheduler = Scheduler(runner, args.max_running_requests, args.batch_wait_ms)
    scheduler.weight_version = args.weight_version
    context = args.context_length or context_length(args.model_path)
    chat = ChatFormat(runner.tokenizer, args.chat_template, args.tool_call_parser)
    server = Server(
        runner,
        scheduler,
        WeightUpdates(runner, scheduler, tp),
        context,
        args.allow_auto_truncate,
        chat=chat,
        served_model_name=args.served_model_name,
    )
    log.info(
        "serving %s on %s port %d (tp_size %d, context length %d, torch threads %d)",
        args.model_path,
        args.host,
        args.port,
        args.tp_size,
        context,
        threads,
    )
    app = server.app()
    freeze_startup_heap("server")  # the model is loaded; what requests allocate is collected as before
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


def set_torch_threads(requested: int) -> int:
    """Set torch's intra-op threads: ``requested``, or with 0 this process's cores less the one the HTTP loop
    needs. On a small machine every torch thread beyond the free cores spin-waits against the loop answering
    requests (2 threads on 2 shared cores made a step of 512 short requests several times slower than 1)."""
    import torch

    threads = requested or max(1, usable_cores() - 1)
    torch.set_num_threads(threads)
    return threads


if __name__ == "__main__":
    main()
