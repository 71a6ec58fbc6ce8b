"""``torchrun ... -m hpcrl.train.worker --model-path P``: one trainer rank.

For now a rank joins the group, loads and shards the model, logs ``ready`` and leaves cleanly; the RPC
server that will drive the engine comes later. torch is imported inside ``main`` so ``--help`` and
argument errors come back at once.
"""

from __future__ import annotations

import argparse
import logging
import os

logger = logging.getLogger("hpcrl.train.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="local Hugging Face model directory")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (model.dtype)")
    parser.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (train.lr)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="train.micro_batch_tokens")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of every collective, seconds")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hpcrl.logs import setup_logging

    setup_logging("trainer", os.environ.get("RANK", "0"), args.log_level)

    import torch.distributed as dist

    from hpcrl.config.schema import TrainConfig
    from hpcrl.train.dist import init_distributed
    from hpcrl.train.engine import Engine

    info = init_distributed(timeout_s=args.timeout_s)
    try:
        train = TrainConfig(lr=args.lr, micro_batch_tokens=args.micro_batch_tokens)
        engine = Engine(args.model_path, train, dtype=args.dtype, dist=info)
        engine.setup()
        logger.info("ready")
        dist.barrier(group=info.meta_group)  # leave together: no rank tears down while another still loads
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
