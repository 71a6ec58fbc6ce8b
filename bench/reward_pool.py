"""Reward pool throughput: ``python bench/reward_pool.py [--workers 2] [--items 512] [--steps 20]``.

Prints calls per second for the built-in mod10 reward (the cost is the pool's, not the reward's) over
``steps`` rounds of ``items`` calls, the size of one train step's batch, and the pool's start time.
"""

import argparse
import asyncio
import time

from hpcrl.reward.pool import RewardPool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="hpcrl.reward.builtin:mod10")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--items", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    items = [(f"{i % 10}+{i // 10 % 10}=", f"{i % 7} and some text", str(i % 10)) for i in range(args.items)]
    start = time.perf_counter()
    with RewardPool(args.spec, workers=args.workers, timeout_s=10) as pool:
        started = time.perf_counter() - start
        asyncio.run(pool.score(items))  # warm-up
        step_s = []
        for _ in range(args.steps):
            t = time.perf_counter()
            outcomes = asyncio.run(pool.score(items))
            step_s.append(time.perf_counter() - t)
            assert all(o.ok for o in outcomes)
    total = sum(step_s)
    print(f"{args.spec}: {args.workers} workers, start {started:.2f} s")
    print(
        f"{args.items} calls per step: median {sorted(step_s)[len(step_s) // 2] * 1e3:.1f} ms per step, "
        f"{args.items * args.steps / total:,.0f} calls/s"
    )


if __name__ == "__main__":
    main()
