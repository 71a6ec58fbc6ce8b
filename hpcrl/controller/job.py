"""The job ``python -m hpcrl.main`` runs: data, model, workers, the loop, and its summary.

    prepare: data splits -> prompts as the model sees them (dataset.chat_template) -> model directory (a tiny one is
             made for the task; its path in the run's config) -> secret
    start:   scheduler (local, or Slurm) -> server workers + trainer ranks (+ critic ranks, + rollout workers, + the
             reward model's server workers; each registers host:port when it serves); the reward pool gets the
             reward model's addresses
    run:     Loop (rollout -> train -> weight sync -> eval -> metrics) until the budget or the target
    end:     the trained model exported to <run dir>/final/ (Hugging Face layout), the critic to final_critic/;
             trainers and critic shut down over RPC;
             leaving the scheduler's block stops every process tree by PID

Healthy shutdown: the loop returns, workers are told to stop (trainer and critic ranks get SHUTDOWN_WAIT_S to
exit on their own), then the scheduler ends what is left.
Crash shutdown (an exception, Ctrl-C, SIGTERM, a dead worker): the exception unwinds through the
scheduler's context manager, which ends every worker's process tree; the error names the worker. A trainer or
critic call with no reply within cluster.hang_timeout_s, or a worker whose lease the controller could not renew,
first writes the hang report (``hang.py``: every worker's stacks, gathered while they still run) and fails the run
naming the worker that did not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.config.load import dump_config
from hpcrl.config.preflight import row_rewards
from hpcrl.config.schema import Config
from hpcrl.controller.hang import HangError, lost_worker, slurm_jobs, stalled_call, write_hang_report
from hpcrl.controller.metrics import plot
from hpcrl.controller.preempt import PreemptionGuard
from hpcrl.controller.progress import Progress
from hpcrl.controller.roles import role_specs
from hpcrl.controller.servers import ServerPool
from hpcrl.controller.startup import Startup
from hpcrl.controller.weights import WeightSync
from hpcrl.gc_freeze import freeze_startup_heap
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.options import client_options
from hpcrl.launch.addresses import port_range, worker_addresses
from hpcrl.launch.base import Scheduler, WorkerFailed, WorkerGroup
from hpcrl.launch.controller_file import write_controller_file
from hpcrl.launch.lease import LeaseKeeper, with_lease
from hpcrl.launch.local import LocalScheduler
from hpcrl.launch.registry import Entry, Registry
from hpcrl.launch.slots import PortSlots
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.registry import RewardFns
from hpcrl.rollout.proxy.server import loopback
from hpcrl.rollout.workflows.plugin import is_plugin
from hpcrl.rollout.workflows.plugin import resolve as resolve_workflow
from hpcrl.rpc.auth import create_token, read_token
from hpcrl.rundir import RunDir

if TYPE_CHECKING:
    from hpcrl.controller.trainers import Trainers

log = logging.getLogger(__name__)


def run_job(cfg: Config, run_dir: RunDir, preempt: PreemptionGuard | None = None) -> dict[str, Any]:
    from hpcrl.data import decode_columns, load_splits

    startup = Startup()
    startup.mark("python, imports, config")

    if is_plugin(cfg.workflow.name):  # imported here first: one that does not import fails before anything starts
        resolve_workflow(cfg.workflow.name)
    # the columns every reward's functions take go with each row (reward.fn's, eval.reward_fn's, a verifier's)
    rewards = row_rewards(cfg, RewardFns.resolve(cfg.reward.fn, cfg.reward.weights))
    train, held_out = load_splits(cfg.dataset, cfg.run.seed, batch=cfg.rollout.prompts_per_step, rewards=rewards)
    train_rows, eval_rows = prepare_rows(cfg, list(map(decode_columns, train)), list(map(decode_columns, held_out)))
    model_path = prepare_model(cfg, run_dir, train_rows + eval_rows)
    startup.mark("data and model")
    resolved = with_model_paths(cfg, model_path)
    if resolved != cfg:  # a new run's (a resume's is resolved): workers read where the models are
        cfg = resolved
        run_dir.write_config(dump_config(cfg))
    token = read_token(run_dir.path) if (run_dir.path / "secret").exists() else create_token(run_dir.path)
    alloc = cfg.allocation
    counts = {
        "server": alloc.server.workers,
        "trainer": alloc.trainer.workers,
        "critic": alloc.critic.workers,
        "rollout": cfg.rollout.workers,
        "reward_model": alloc.reward_model.workers,
    }
    torchrun_roles = ("trainer", "critic") if alloc.critic.workers else ("trainer",)
    slots = PortSlots({role: n for role, n in counts.items() if n}, rendezvous=torchrun_roles)
    controller = secrets.token_hex(8)  # this controller's id: workers hold their lease on it, and it alone
    write_controller_file(run_dir.path, controller, cfg.cluster.worker_lease_s, slots)  # for servers that join
    lease_s = cfg.cluster.worker_lease_s
    specs = [with_lease(spec, controller, lease_s) for spec in role_specs(cfg)]
    registry = Registry(run_dir.registry)
    groups: dict[str, Callable[[], WorkerGroup]] = {}  # role -> its group now (a server restart may replace it)

    def mark_lost(entry: Entry, why: str) -> None:  # the lease keeper's verdict, for the watchdog to act on
        if entry.role in groups:
            groups[entry.role]().mark_lost(entry.rank, why)

    with (
        make_scheduler(cfg, run_dir, slots) as scheduler,
        RewardPool.for_config(cfg.reward) as reward_pool,
        # renews every worker's lease from the moment it registers, and notices one it can no longer reach
        LeaseKeeper(registry, [spec.role for spec in specs], controller, token, lease_s, mark_lost),
    ):
        started = dict(zip([spec.role for spec in specs], scheduler.start_all(specs), strict=True))
        import_the_loop()  # while the workers start
        servers, trainers, critics = started["server"], started["trainer"], started.get("critic")
        groups.update(server=lambda: servers, trainer=lambda: trainers)  # rollout workers: RemoteEpisodes copes
        if critics is not None:
            groups["critic"] = lambda: critics
        reward_models = started.get("reward_model")  # its weights never change: no weight sync reaches it
        if reward_models is not None:
            groups["reward_model"] = lambda: reward_models
        server_entries = servers.wait_ready()
        trainer_entries = trainers.wait_ready()
        critic_entries = critics.wait_ready() if critics is not None else []
        rollout_entries = started["rollout"].wait_ready() if "rollout" in started else []
        if reward_models is not None:  # the reward functions here score through its servers
            reward_pool.use_reward_model([e.address for e in reward_models.wait_ready()])

        startup.mark("workers")
        pool = ServerPool(cfg, servers, server_entries, scheduler)
        groups["server"] = lambda: pool.group

        def check_alive() -> None:
            pool.check()  # drops or restarts a dead server (inference.on_server_exit), or raises naming it
            trainers.check_alive()  # a rank the lease keeper could not reach for a whole lease counts as ended
            if critics is not None:
                critics.check_alive()
            if reward_models is not None:  # a dead one fails the run naming it ("reward_model worker 0 exited ...")
                reward_models.check_alive()

        from hpcrl.controller.loop import Workers

        # client and trainers are opened below
        workers = Workers(None, None, reward_pool, check_alive, servers=pool, startup=startup)
        if is_plugin(cfg.workflow.name):  # its proxy, for episodes and evaluation here: a port of the controller's slot
            workers.proxy_host = loopback(worker_addresses(cfg.cluster.net)[0])
            workers.proxy_ports = slots.allocator(slots.controller, port_range(cfg.cluster.net))
        roles = (server_entries, trainer_entries, rollout_entries, critic_entries)
        addresses = [[e.address for e in entries] for entries in roles]
        rows = (train_rows, eval_rows)
        try:
            summary = asyncio.run(_drive(cfg, run_dir, workers, addresses, token, rows, preempt))
        except Exception as e:  # a worker silent past its deadline: every worker's stacks, while they still run
            hang = _hang_report(e, run_dir, [w for spec in specs for w in registry.entries(spec.role)], groups, started)
            if hang is None:
                raise
            raise hang from e
        # the ranks were told to shut down: torchrun SIGTERMed while they exit would log a traceback, so the
        # scheduler stops only what is still running after this
        for group in (trainers, critics):
            if group is not None:
                group.wait_exited(SHUTDOWN_WAIT_S)
    plot(run_dir.path / "metrics.jsonl", run_dir.path / "metrics.png")
    return {**summary, "run_dir": str(run_dir.path)}


def import_the_loop() -> None:
    """Import the loop's modules, torch among them (2-3 s of one core here), once the workers are starting: the
    controller's imports then overlap the workers' start-up instead of delaying it (bench/README.md, start-up)."""
    import hpcrl.controller.loop
    import hpcrl.controller.trainers  # noqa: F401


def _hang_report(
    error: Exception,
    run_dir: RunDir,
    every: list[Entry],
    groups: dict[str, Callable[[], WorkerGroup]],
    started: dict[str, WorkerGroup],
) -> HangError | None:
    """When ``error`` is a call past its deadline or a worker the lease keeper lost: the hang report written
    (``hang.py``) and the error that fails the run naming that worker; else None."""
    lost = {role: group().lost for role, group in groups.items()}
    if (unanswered := stalled_call(error) or lost_worker(error, lost, every)) is None:
        return None
    jobs = slurm_jobs([*started.values(), *(group() for group in groups.values())])
    headline, report = write_hang_report(run_dir.path, every, unanswered, jobs=jobs)
    cause = f"{error.role} worker {error.worker} {error.state}" if isinstance(error, WorkerFailed) else headline
    return HangError(cause, report)


async def _drive(cfg, run_dir, workers, addresses, token, rows, preempt) -> dict[str, Any]:
    train_rows, eval_rows = rows
    from hpcrl.controller.loop import Loop
    from hpcrl.controller.trainers import Trainers
    from hpcrl.models.tokenizer import load_tokenizer

    server_addresses, trainer_addresses, rollout_addresses, critic_addresses = addresses
    tokenizer = load_tokenizer(cfg.model.path)
    pool = workers.servers
    hang_s = cfg.cluster.hang_timeout_s  # every trainer and critic call's deadline (train/dist.py: the collectives')
    async with (
        InferenceClient(server_addresses, **client_options(cfg)) as client,
        Trainers(trainer_addresses, token, cfg.rollout.temperature, hang_s) as trainers,
        _episodes(rollout_addresses, token, cfg.rollout.max_concurrent) as episodes,
        _critics(critic_addresses, token, hang_s) as critics,
    ):
        workers.client, workers.trainers, workers.episodes, workers.critics = client, trainers, episodes, critics
        loop = Loop(cfg, workers, tokenizer, train_rows, eval_rows, run_dir)
        loop.preempt = preempt
        sync = make_sync(cfg, client, trainers, loop.resumed, run_dir)
        sync.episodes = episodes
        pool.client, pool.sync, pool.episodes = client, sync, episodes
        # distributed: trainer rank 0 hosts the group on its own node, with a port of its own slice; LoRA: the
        # initial adapter goes to the servers before any request names it
        await sync.setup()
        if workers.startup is not None:
            workers.startup.mark("weight sync setup")
        with Progress(cfg.run.max_steps) as progress:
            loop.progress = progress.update
            freeze_startup_heap("controller")  # every worker, the data and the loop are up
            summary = await loop.run(sync)
        final = run_dir.path / FINAL_DIR
        await trainers.export(final)  # the weights the last evaluation measured
        log.info("the trained model, in Hugging Face layout: %s", final)
        summary["final_model"] = str(final)
        if critics is not None:
            await critics.export(run_dir.path / FINAL_CRITIC_DIR)  # a value model directory: model.critic_path reads it
            summary["final_critic"] = str(run_dir.path / FINAL_CRITIC_DIR)
        await sync.close()
        await trainers.shutdown()
        if critics is not None:
            await critics.shutdown()
        if episodes is not None:
            log.info("episodes each rollout worker ran, by rank: %s", json.dumps(episodes.completed))
            await episodes.shutdown()
    return summary


def make_sync(cfg: Config, client: InferenceClient, trainers: Trainers, resumed: asyncio.Event, run_dir: RunDir):
    """The weight sync of ``train.weight_sync``: of the whole model, or with LoRA of the policy's adapter."""
    weights = run_dir.path / "weights"
    dtype = cfg.model.dtype  # the servers run in it (--dtype): a push sends that, not the optimizer's fp32
    if cfg.train.lora.rank:
        from hpcrl.controller.adapter_sync import AdapterSync

        return AdapterSync(cfg.train.weight_sync, client, trainers, resumed, weights, dtype=dtype)
    bucket_bytes = cfg.train.weight_sync_bucket_mb << 20
    return WeightSync(cfg.train.weight_sync, client, trainers, resumed, weights, dtype=dtype, bucket_bytes=bucket_bytes)


def make_scheduler(cfg: Config, run_dir: RunDir, slots: PortSlots) -> Scheduler:
    """Local subprocesses, or Slurm jobs (cluster.submit_mode: one hetjob, or one job per role)."""
    ports = port_range(cfg.cluster.net)
    if cfg.cluster.kind == "slurm":
        from hpcrl.launch.slurm import SlurmScheduler

        return SlurmScheduler(run_dir, slots, cfg.cluster, ports, job_prefix=f"hpcrl-{cfg.run.experiment}-")
    return LocalScheduler(run_dir, slots, ports)


@contextlib.asynccontextmanager
async def _episodes(addresses: list[str], token: str, max_in_flight: int) -> AsyncIterator[Any]:
    """``RemoteEpisodes`` to the rollout workers, or None when the controller runs the episodes itself."""
    if not addresses:
        yield None
        return
    from hpcrl.rollout.remote import RemoteEpisodes

    async with RemoteEpisodes(addresses, token, max_in_flight=max_in_flight) as episodes:
        yield episodes


@contextlib.asynccontextmanager
async def _critics(addresses: list[str], token: str, timeout_s: float) -> AsyncIterator[Any]:
    """``Critics`` to the critic's ranks, or None without a critic."""
    if not addresses:
        yield None
        return
    from hpcrl.controller.critics import Critics

    async with Critics(addresses, token, timeout_s) as critics:
        yield critics


SHUTDOWN_WAIT_S = 10.0  # how long trainer and critic ranks get to exit on their own once shut down over RPC
FINAL_DIR = "final"  # <run dir>/final/: the trained model at the end of the run
FINAL_CRITIC_DIR = "final_critic"  # <run dir>/final_critic/: the trained critic (a value model directory)


def with_model_paths(cfg: Config, model_path: Path) -> Config:
    """``cfg`` with ``model.path`` the model directory the workers read and ``reward.model.path`` absolute (workers
    on other nodes read both from config.yaml)."""
    cfg = replace(cfg, model=replace(cfg.model, path=str(model_path)))
    rm = cfg.reward.model
    if rm.path:
        absolute = str(Path(rm.path).expanduser().absolute())
        cfg = replace(cfg, reward=replace(cfg.reward, model=replace(rm, path=absolute)))
    return cfg


def prepare_rows(cfg: Config, train: list[dict], held_out: list[dict]) -> tuple[list[dict], list[dict]]:
    """The rows with each prompt as the model sees it (``hpcrl.data.chat``: the chat template on string prompts
    under dataset.chat_template, and on chat-format rows); a plug-in's as written. The tiny model's tokenizer is
    made with every character (its template is the same whatever its alphabet); ``prepare_model`` then takes the
    alphabet from these prompts."""
    from hpcrl.data.chat import render_prompts
    from hpcrl.data.files import DataError

    if is_plugin(cfg.workflow.name):  # the agent's own messages are templated by its proxy (check_plugin_prompts)
        rows = train + held_out
        conversation = next((i for i, row in enumerate(rows) if row.get("messages")), None)
        if conversation is not None:
            raise DataError(
                f"row {conversation} is a conversation (a list of messages); a plug-in workflow takes string prompts "
                f"({cfg.workflow.name} puts each in messages of its own)"
            )
        return train, held_out
    if cfg.model.source == "local":
        from hpcrl.models.tokenizer import load_tokenizer

        tokenizer, where = load_tokenizer(cfg.model.path), f"the tokenizer of model.path={cfg.model.path}"
    else:
        from hpcrl.models.tiny import make_tokenizer

        tokenizer, where = make_tokenizer(), "the tiny model's tokenizer"
    rows = render_prompts(train + held_out, tokenizer, cfg.dataset.chat_template, where)
    return rows[: len(train)], rows[len(train) :]


def prepare_model(cfg: Config, run_dir: RunDir, rows: list[dict[str, str]]) -> Path:
    """The model directory: model.path (absolute, as workers on other nodes read it from config.yaml), or a tiny
    model made for the task's characters (reused if there).

    The alphabet holds every character of the rows and of the text the workflow adds (``workflow_text``);
    a small alphabet is what lets the tiny model learn in minutes."""
    if cfg.model.source == "local":
        return Path(cfg.model.path).expanduser().absolute()
    out = run_dir.path / "model"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from hpcrl.models.tiny import make_tiny_model

    # the task's characters, and those the workflow puts between the model's turns
    text = [r["prompt"] + r["answer"] for r in rows] + workflow_text(cfg)
    characters = "".join(sorted({c for t in text for c in t}))
    t = cfg.model.tiny
    log.info("making a tiny model in %s (alphabet %r)", out, characters)
    return make_tiny_model(
        out,
        hidden_size=t.hidden_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        intermediate_size=t.intermediate_size,
        seed=cfg.run.seed,
        characters=characters,
    )


def workflow_text(cfg: Config) -> list[str]:
    """Text the workflow puts into trajectories besides the rows: multi-turn feedback, pipeline stages
    (their ``{field}`` names too, a few unused tokens that keep this simple), a plug-in's chat template around
    its turns and what the plug-in says it writes (its ``text`` attribute)."""
    w = cfg.workflow
    if is_plugin(w.name):
        from hpcrl.inference.openai.chat import ChatFormat
        from hpcrl.models.tiny import make_tokenizer
        from hpcrl.rollout.workflows.plugin import extra_text, resolve

        return [ChatFormat(make_tokenizer(), w.chat_template).own_text(), *extra_text(resolve(w.name))]
    if w.name == "multi_turn":  # the feedback as the model sees it: a user turn in the chat template
        from hpcrl.models.tiny import make_tokenizer
        from hpcrl.rollout.workflows.multi_turn import feedback_text

        return [feedback_text(make_tokenizer(), w.feedback)]
    return list(w.stages) if w.name == "pipeline" else []
