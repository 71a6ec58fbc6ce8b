"""Evaluation only (``run.max_steps=0``): a model on the held-out set, with the run's reward, and nothing trained.

model:   model.path: a Hugging Face directory (a run's final/ or exports/step_N, or any other), or a run's
         checkpoint (<run dir>/checkpoints/step_N: its model written to <this run dir>/model/ first,
         ``hpcrl.train.checkpoint_model``); with model.source=tiny the untrained tiny model made for the task
start:   the servers only (allocation.server), the reward processes, and the reward model's servers when it has
         some (allocation.reward_model); no trainer, no critic, no rollout worker
measure: the held-out rows answered as a training run's evaluation answers them (greedy, rollout.max_new_tokens;
         a plug-in workflow's own episodes), each scored by reward.fn (eval.reward_fn when set); every row's
         completion and reward in <run dir>/eval_samples.jsonl (not for a plug-in, whose episodes are its own)
summary: steps 0, eval_accuracy, eval_rows, evaluated_model, wall_s, run_dir (main prints it and writes
         summary.json)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcrl.config.load import dump_config
from hpcrl.config.preflight import row_rewards
from hpcrl.config.schema import Config
from hpcrl.controller.evaluate import eval_reward_pool, greedy_scored, mean_reward
from hpcrl.controller.job import make_scheduler, prepare_model, prepare_rows, with_model_paths
from hpcrl.controller.roles import reward_model_specs, server_spec
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.options import client_options
from hpcrl.launch.addresses import port_range, worker_addresses
from hpcrl.launch.base import WorkerGroup
from hpcrl.launch.lease import LeaseKeeper, with_lease
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slots import PortSlots
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.registry import RewardFns
from hpcrl.rollout.proxy.server import loopback
from hpcrl.rollout.workflows.plugin import is_plugin
from hpcrl.rollout.workflows.plugin import resolve as resolve_workflow
from hpcrl.rundir import RunDir, write_atomic

log = logging.getLogger(__name__)

SAMPLES_FILE = "eval_samples.jsonl"  # <run dir>/eval_samples.jsonl: each held-out row's completion and reward
CHECKPOINT_MODEL_DIR = "model"  # <run dir>/model/: a checkpoint's model, written to be served


def run_eval_only(cfg: Config, run_dir: RunDir) -> dict[str, Any]:
    """Evaluate the model of ``cfg`` on the held-out rows; return the summary (see the module's docstring)."""
    from hpcrl.data import decode_columns, load_splits
    from hpcrl.train.checkpoint_model import is_checkpoint, write_checkpoint_model

    start = time.monotonic()
    if is_plugin(cfg.workflow.name):  # imported here first: one that does not import fails before anything starts
        resolve_workflow(cfg.workflow.name)
    rewards = row_rewards(cfg, RewardFns.resolve(cfg.reward.fn, cfg.reward.weights))
    evaluated = cfg.model.path
    if cfg.model.source == "local" and is_checkpoint(evaluated):  # its model first: the rows take its tokenizer
        cfg = _with_model(cfg, run_dir, write_checkpoint_model(evaluated, run_dir.path / CHECKPOINT_MODEL_DIR))
    train, held_out = load_splits(cfg.dataset, cfg.run.seed, batch=1, rewards=rewards)  # no batch is trained
    train_rows, eval_rows = prepare_rows(cfg, list(map(decode_columns, train)), list(map(decode_columns, held_out)))
    model_path = prepare_model(cfg, run_dir, train_rows + eval_rows)
    evaluated = evaluated or str(model_path)
    cfg = _with_model(cfg, run_dir, model_path)
    accuracy = _serve_and_evaluate(cfg, run_dir, eval_rows)
    log.info("held-out accuracy of %s: %.4f (%d rows)", evaluated, accuracy, len(eval_rows))
    return {
        "steps": 0,
        "eval_accuracy": accuracy,
        "eval_rows": len(eval_rows),
        "evaluated_model": str(Path(evaluated).expanduser().absolute()),
        "wall_s": round(time.monotonic() - start, 2),
        "run_dir": str(run_dir.path),
    }


def _with_model(cfg: Config, run_dir: RunDir, path: Path) -> Config:
    """``cfg`` serving the model directory ``path`` (and the reward model's, absolute), written to the run's config
    (the servers read it there)."""
    resolved = with_model_paths(replace(cfg, model=replace(cfg.model, source="local")), path)
    if resolved == cfg:
        return cfg
    run_dir.write_config(dump_config(resolved))
    return resolved


def _serve_and_evaluate(cfg: Config, run_dir: RunDir, rows: list[dict[str, Any]]) -> float:
    """Start the servers (with their leases, as a training run's), the reward model's and the reward processes,
    evaluate, stop them."""
    from hpcrl.rpc.auth import create_token, read_token

    token = read_token(run_dir.path) if (run_dir.path / "secret").exists() else create_token(run_dir.path)
    specs = [server_spec(cfg), *reward_model_specs(cfg)]
    slots = PortSlots({spec.role: spec.workers for spec in specs}, rendezvous=())
    controller, lease_s = secrets.token_hex(8), cfg.cluster.worker_lease_s
    specs = [with_lease(spec, controller, lease_s) for spec in specs]
    groups: dict[str, WorkerGroup] = {}

    def mark_lost(entry: Entry, why: str) -> None:
        if entry.role in groups:
            groups[entry.role].mark_lost(entry.rank, why)

    with (
        make_scheduler(cfg, run_dir, slots) as scheduler,
        RewardPool.for_config(cfg.reward) as rewards,
        LeaseKeeper(Registry(run_dir.registry), [spec.role for spec in specs], controller, token, lease_s, mark_lost),
    ):
        groups.update(zip([spec.role for spec in specs], scheduler.start_all(specs), strict=True))
        servers = groups["server"]
        addresses = [entry.address for entry in servers.wait_ready()]
        if "reward_model" in groups:  # the reward functions score through its servers
            rewards.use_reward_model([entry.address for entry in groups["reward_model"].wait_ready()])
        ports = slots.allocator(slots.controller, port_range(cfg.cluster.net))
        with eval_reward_pool(cfg, rewards) or contextlib.nullcontext(rewards) as scoring:  # eval.reward_fn's, if any
            return asyncio.run(_evaluate(cfg, run_dir, list(groups.values()), addresses, rows, scoring, ports))


async def _evaluate(cfg, run_dir, groups, addresses, rows, rewards, ports) -> float:
    from hpcrl.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.path)
    async with InferenceClient(addresses, **client_options(cfg)) as client:
        if is_plugin(cfg.workflow.name):
            measure = _plugin_accuracy(cfg, client, tokenizer, rows, rewards, ports)
        else:
            measure = _greedy_accuracy(cfg, run_dir, client, tokenizer, rows, rewards)
        return await _while_alive(measure, groups)


async def _greedy_accuracy(cfg, run_dir, client, tokenizer, rows, rewards) -> float:
    scored = await greedy_scored(client, tokenizer, rows, rewards, cfg.rollout.max_new_tokens)
    lines = [
        json.dumps({"prompt": row["prompt"], "answer": row["answer"], "completion": text, "reward": reward})
        for row, (text, reward) in zip(rows, scored, strict=True)
    ]
    write_atomic(run_dir.path / SAMPLES_FILE, "".join(line + "\n" for line in lines))
    return mean_reward([reward for _, reward in scored])


async def _plugin_accuracy(cfg, client, tokenizer, rows, rewards, ports) -> float:
    from hpcrl.rollout.workflows import close_workflow, make_workflow

    resumed = asyncio.Event()
    resumed.set()  # no weight update pauses an evaluation
    host = loopback(worker_addresses(cfg.cluster.net)[0])
    workflow = make_workflow(cfg, client, tokenizer, rewards, resumed, host=host, ports=ports)
    try:
        return await workflow.accuracy(rows)
    finally:
        await close_workflow(workflow)


async def _while_alive(measure, groups: list[WorkerGroup], period_s: float = 1.0) -> float:
    """``measure``'s result, failing naming the server (or reward-model server) as soon as one dies (its requests
    might otherwise wait for a restart that never comes, up to the client's deadline)."""
    task = asyncio.ensure_future(measure)
    try:
        while not task.done():
            for group in groups:
                group.check_alive()
            await asyncio.wait([task], timeout=period_s)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
