"""``python -m hpcrl.inference.server --model-path DIR --host H --port N [...]``."""

from __future__ import annotations

import argparse
import logging
import os

from hpcrl.cores import usable_cores
from hpcrl.errors import UserError, exit_on_user_error
from hpcrl.gc_freeze import pause_until_frozen
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
    p.add_argument(
        "--is-embedding",
        action="store_true",
        help="serve a sequence-classification model (reward model) on /classify",
    )
    p.add_argument("--rank", default=os.environ.get("HPCRL_RANK", "0"), help="worker rank, for log lines")
    add_lora_args(p)
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
    args.lora = lora_settings_or_exit(p, args)
    return args


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """SGLang's LoRA flags, as it names and types them (``srt/arg_groups/fields/lora.py``)."""
    from hpcrl.inference.server.lora import ALL, TARGET_MODULES

    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (on with --lora-paths)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank; default: --lora-paths'")
    p.add_argument(
        "--lora-target-modules",
        nargs="*",
        choices=[*TARGET_MODULES, ALL],
        default=None,
        help="modules adapters may target; default: --lora-paths' union",
    )
    p.add_argument(
        "--lora-paths",
        nargs="*",
        default=None,
        help='adapters loaded at start: PATH | NAME=PATH | JSON {"lora_name",...}',
    )
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="distinct adapters in a batch, the base included")


def lora_settings_or_exit(p: argparse.ArgumentParser, args: argparse.Namespace):
    """The LoRA settings, or the parser's one-line error with SGLang's message."""
    from hpcrl.inference.server.lora import lora_settings

    try:
        lora = lora_settings(
            args.enable_lora, args.max_lora_rank, args.lora_target_modules, args.lora_paths, args.max_loras_per_batch
        )
    except (OSError, KeyError, ValueError) as e:
        p.error(f"LoRA: {e}")
    if lora.enabled and args.tp_size > 1:
        p.error(
            f"--enable-lora with --tp-size {args.tp_size}: hpcrl's CPU server applies adapters on tp rank 0 only; "
            "use --tp-size 1"
        )
    return lora


def main(argv: list[str] | None = None) -> None:
    pause_until_frozen()  # start-up allocates what lives until exit: no collection walks it (gc_freeze.py)
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
    from hpcrl.inference.server.classify import reward_model_kind

    try:
        reward_model = reward_model_kind(args.model_path, args.is_embedding)
    except (OSError, ValueError) as e:
        raise UserError(str(e), "give a model directory whose config.json names a class SGLang serves") from None
    if reward_model:
        serve_reward_model(args)
        return
    from hpcrl.inference.context import context_length
    from hpcrl.inference.openai.chat import ChatFormat
    from hpcrl.inference.server.app import Server
    from hpcrl.inference.server.lora import Adapters
    from hpcrl.inference.server.runner import ModelRunner
    from hpcrl.inference.server.scheduler import Scheduler
    from hpcrl.inference.server.tp_ranks import TpRanks
    from hpcrl.inference.server.weights import WeightUpdates

    tp = TpRanks(args.tp_size)  # first: the children import torch while this process loads the model
    threads = set_torch_threads(args.torch_threads)
    runner = ModelRunner(args.model_path, args.dtype, args.seed)
    scheduler = Scheduler(runner, args.max_running_requests, args.batch_wait_ms)
    scheduler.weight_version = args.weight_version
    adapters = Adapters(args.lora, runner, scheduler)
    try:
        adapters.load_initial()
    except ValueError as e:
        raise UserError(
            str(e), "give PEFT adapter directories that fit --max-lora-rank and --lora-target-modules"
        ) from None
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
        adapters=adapters,
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


def serve_reward_model(args: argparse.Namespace) -> None:
    """A sequence-classification model on SGLang's ``/classify`` (``classify.py``); generation settings do not apply."""
    from aiohttp import web

    from hpcrl.gc_freeze import freeze_startup_heap
    from hpcrl.inference.context import context_length
    from hpcrl.inference.server.classify import ClassifyRunner, ClassifyServer

    refuse_generation_flags(args)
    threads = set_torch_threads(args.torch_threads)
    context = args.context_length or context_length(args.model_path)
    server = ClassifyServer(ClassifyRunner(args.model_path, args.dtype), context, args.weight_version)
    log.info("serving reward model %s on %s port %d (context length %d, torch threads %d)",
             args.model_path, args.host, args.port, context, threads)  # fmt: skip
    app = server.app()
    freeze_startup_heap("server")
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


def refuse_generation_flags(args: argparse.Namespace) -> None:
    """A reward model has nothing to generate, update or adapt: a flag for that would be silently ignored."""
    flags = {
        "--tp-size": args.tp_size != 1,
        "--enable-lora": args.lora.enabled,
        "--chat-template": bool(args.chat_template),
        "--allow-auto-truncate": args.allow_auto_truncate,
        "--tool-call-parser": args.tool_call_parser != "none",
        "--served-model-name": bool(args.served_model_name),
    }
    given = [flag for flag, on in flags.items() if on]
    if given:
        raise UserError(f"{', '.join(given)} with a reward model", "the CPU server scores reward models on one rank")


def set_torch_threads(requested: int) -> int:
    """Set torch's intra-op threads: ``requested``, or with 0 this process's cores less the one the HTTP loop
    needs, each flushing subnormal floats to zero. On a small machine every torch thread beyond the free cores
    spin-waits against the loop answering requests (2 threads on 2 shared cores made a step of 512 short requests
    several times slower than 1)."""
    import torch

    from hpcrl.denormals import flush_denormals

    threads = requested or max(1, usable_cores() - 1)
    torch.set_num_threads(threads)
    flush_denormals()  # before the threads start: subnormals slowed one seed's generation 1.7x (hpcrl/denormals.py)
    return threads


if __name__ == "__main__":
    main()
