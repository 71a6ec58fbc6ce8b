"""``python -m hpcrl.rollout.agents.evaluate --base-url URL --run-dir DIR``: an agent's held-out accuracy against
any OpenAI-compatible server, without hpcrl's loop.

The same episode function a run trains (``workflow.name``) runs once per held-out row, greedily (temperature
0), against ``URL`` (e.g. ``http://127.0.0.1:30000/v1``: hpcrl's CPU server or SGLang, serving the trained model
with the run's chat template and tool-call parser); its final reward is scored by the run's ``reward.fn``, here
in this process. ``--run-dir`` takes the agent, the reward, the held-out rows and the sampling from the config a
run uses (``config.yaml``, or the newest ``config.resumed-N.yaml``: ``RunDir.config_file``; the rollout's
``max_tokens``, ``top_p`` and ``stop``: the ``ep.sampling`` the run's own held-out evaluation gives the agent);
``--agent``, ``--reward``, ``--eval-size``, ``--seed`` and ``--max-tokens`` set them for the default task without
one. Prints one JSON line:
``{"accuracy": ..., "rows": ..., "agent": ..., "base_url": ...}``.

Rewards an episode gives with ``set_reward`` count too: its final reward is the one it returns, else the last it
set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from hpcrl.errors import UserError, exit_on_user_error

DEFAULT_AGENT = "hpcrl.rollout.agents.mod10:calculator_agent"
DEFAULT_REWARD = "hpcrl.reward.builtin:mod10"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcrl.rollout.agents.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:30000/v1")
    p.add_argument("--run-dir", help="a run directory: agent, reward, held-out rows and max_tokens from its config")
    p.add_argument("--agent", default=None, help=f"module:function of the episode (default {DEFAULT_AGENT})")
    p.add_argument("--reward", default=None, help=f"module:function of the reward (default {DEFAULT_REWARD})")
    p.add_argument("--eval-size", type=int, default=200, help="held-out rows of the default task (without --run-dir)")
    p.add_argument("--seed", type=int, default=0, help="run.seed the default task's rows are drawn with")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens of every request (default: the run's, 1)")
    p.add_argument("--concurrency", type=int, default=64, help="episodes at once")
    p.add_argument("--model", default="default", help="the model name requests carry")
    p.add_argument("--verbose", action="store_true", help="a traceback for errors of the input too (a bad --run-dir)")
    return p.parse_args(argv)


def settings(args: argparse.Namespace) -> tuple[str, Any, list[float], list[dict[str, Any]], dict[str, Any]]:
    """(agent, reward (reward.fn: one spec or a list), its weights, held-out rows, the sampling every request
    carries), from the run's config or the arguments. A row holds the columns the reward takes, if any.

    The sampling is what the run's own held-out evaluation gives the agent (``ep.sampling``): the rollout's, greedy."""
    from hpcrl.rollout.workflows.agent import openai_sampling

    if args.run_dir:
        from hpcrl.config.load import load_run_config
        from hpcrl.data import decode_columns, load_splits
        from hpcrl.reward.registry import RewardFns
        from hpcrl.rollout.workflows.base import sampling_params
        from hpcrl.rundir import RunDir

        cfg = load_run_config(RunDir(Path(args.run_dir)).config_file)
        reward, weights = cfg.reward.fn, list(cfg.reward.weights)
        _, held_out = load_splits(cfg.dataset, cfg.run.seed, rewards=RewardFns.resolve(reward, weights))
        held_out = [decode_columns(r) for r in held_out]
        agent, sampling = cfg.workflow.name, sampling_params(cfg.rollout)
    else:
        from hpcrl.data import make_mod10

        _, held_out = make_mod10(0, args.eval_size, args.seed)
        agent, reward, weights, sampling = DEFAULT_AGENT, DEFAULT_REWARD, [], {"max_new_tokens": 1}
    if args.max_tokens:
        sampling["max_new_tokens"] = args.max_tokens
    if args.reward:
        reward, weights = args.reward, []
    rows = [
        {"prompt": r["prompt"], "answer": r["answer"], **({"columns": r["columns"]} if r.get("columns") else {})}
        for r in held_out
    ]
    return args.agent or agent, reward, weights, rows, openai_sampling({**sampling, "temperature": 0.0})


async def evaluate(
    agent: str, reward: Any, rows: list[dict[str, Any]], base_url: str, sampling: dict[str, Any], *, model: str,
    concurrency: int = 64, weights: list[float] | None = None,
) -> float:  # fmt: skip
    """Mean final reward of one run of ``agent`` per row against ``base_url``; ``reward`` is reward.fn (one spec, or a
    list weighed by ``weights``)."""
    import openai

    from hpcrl.reward.registry import RewardFns, to_reward
    from hpcrl.rollout.workflows.base import EpisodeContext
    from hpcrl.rollout.workflows.plugin import resolve

    episode, fns = resolve(agent), RewardFns.resolve(reward, weights or ())
    gate = asyncio.Semaphore(concurrency)
    async with openai.DefaultAsyncHttpxClient(timeout=600) as http:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", http_client=http, max_retries=2)

        async def one(row: dict[str, Any]) -> float:
            given: list[float] = []

            async def score(text: str) -> float:
                item = (row["prompt"], text, row["answer"], row.get("columns") or {})
                return fns.combine([to_reward(fn(*item)) for fn in fns.rewards])[0]

            ctx = EpisodeContext(
                row=row,
                client=client,
                base_url=base_url,
                sampling=dict(sampling),
                index=0,
                seed=None,
                set_reward=lambda _id, value, index=None: given.append(to_reward(value)),
                score=score,
                model=model,
            )
            async with gate:
                final = await episode(ctx)
            return to_reward(final) if final is not None else (given[-1] if given else 0.0)

        try:
            rewards = await asyncio.gather(*(one(r) for r in rows))
        except (openai.APIConnectionError, openai.NotFoundError) as e:  # no server there, or not its OpenAI API
            raise server_error(base_url, e) from e
    return statistics.fmean(rewards) if rewards else 0.0


def server_error(base_url: str, e: Exception) -> UserError:
    """The one line for a server that does not answer at ``base_url``, or answers 404 (a URL that is not its OpenAI
    API), with how to start one."""
    hint = (
        "start one, e.g. python -m hpcrl.inference.server --model-path RUN_DIR/final --port 30000 (docs/agents.md), "
        "then --base-url http://127.0.0.1:30000/v1"
    )
    if getattr(e, "status_code", None) == 404:
        found = f"the server at {base_url} has no OpenAI API there (404 Not Found)"
        return UserError(f"{found}: --base-url is the API's base, e.g. http://HOST:PORT/v1", hint)
    cause = f"{e.__cause__}" if e.__cause__ else str(e)
    return UserError(f"no server answers at {base_url} ({' '.join(cause.split())})", hint)


def main(argv: list[str] | None = None) -> int:
    """The entry point: a mistake in the input or no server is one line (and a hint), exit code 2."""
    args = parse_args(argv)
    try:
        return evaluate_and_print(args)
    except UserError as e:  # a run directory without a config, an agent that does not import, no server
        exit_on_user_error(e, args.verbose)


def evaluate_and_print(args: argparse.Namespace) -> int:
    agent, reward, weights, rows, sampling = settings(args)
    accuracy = asyncio.run(
        evaluate(
            agent, reward, rows, args.base_url, sampling, model=args.model, concurrency=args.concurrency,
            weights=weights,
        )
    )  # fmt: skip
    print(json.dumps({"accuracy": accuracy, "rows": len(rows), "agent": agent, "base_url": args.base_url}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
