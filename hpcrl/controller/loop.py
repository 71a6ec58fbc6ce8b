"""One RL run's loop: rollout -> train step -> weight sync -> eval -> checkpoint -> metrics, to the budget or target.

Waits: the loop waits on the rollout executor for a batch of accepted groups (the oldest-started ones: see
``hpcrl/rollout/executor.py``), then on the trainers (every rank, one RPC each: the proximal logprobs once for
decoupled PPO and, with a critic, its values of the batch, both at once; then ``algorithm.updates_per_batch``
updates, the critic's beside the actor's), then on the weight sync (in-flight requests aborted, weights loaded,
generation resumed: ``weights.py``). A watchdog checks every second that every worker process is alive; if one
dies, the loop is cancelled and the watchdog's error (naming the worker) is raised. A restarted server's rejoin
runs as a task of its own, so the watchdog never waits on a reload.

Checkpoints and resuming (``recovery.py``): every ``checkpoint.every_steps`` steps, after the step's eval, the
loop takes the controller's state and has the trainers write theirs (then the critic its own, in the step
directory's ``critic/``), writes the step's metrics line, and only then marks the checkpoint complete
(``controller.json``), so no complete checkpoint lacks its step's line. With ``recover.mode=auto`` it starts
from the newest usable checkpoint (a damaged one, or one the trainers or the critic cannot load, is set aside
for the one before): the trainers and the critic load it and the servers get its weights before the first
rollout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpcrl.config.schema import AlgorithmConfig, Config
from hpcrl.controller.batch import apply_gae, rollout_stats, shard, to_sequences
from hpcrl.controller.evaluate import eval_reward_pool, greedy_accuracy
from hpcrl.controller.metrics import MetricsLog, sample_rows
from hpcrl.controller.mismatch import batch_mismatch, first_update_mismatch, log_unmeasured, mask_rejected
from hpcrl.controller.preempt import Preempted, PreemptionGuard
from hpcrl.controller.recovery import Checkpoints, ControllerState, resume_candidates, rng_states, set_rng_states
from hpcrl.controller.rows import TrainingRows
from hpcrl.controller.weights import WeightSync
from hpcrl.inference.client import InferenceClient
from hpcrl.reward.outcome import RewardError
from hpcrl.rollout.executor import RolloutExecutor
from hpcrl.rollout.workflows import close_workflow, make_workflow
from hpcrl.rollout.workflows.base import Group, derive_seed
from hpcrl.rollout.workflows.plugin import is_plugin
from hpcrl.rpc.messages import SequenceData
from hpcrl.train.algorithms import needs_proximal
from hpcrl.train.checkpoint import check_checkpoint

if TYPE_CHECKING:  # types only: importing these here would add the reward pool and RPC to every loop import
    from hpcrl.controller.critics import Critics
    from hpcrl.controller.servers import ServerPool
    from hpcrl.controller.startup import Startup
    from hpcrl.controller.trainers import Trainers
    from hpcrl.net import PortAllocator
    from hpcrl.reward.pool import RewardPool
    from hpcrl.rollout.remote import RemoteEpisodes

log = logging.getLogger(__name__)


@dataclass
class Workers:
    client: InferenceClient  # the inference servers
    trainers: Trainers  # RPC to every trainer rank
    rewards: RewardPool  # the reward processes, when the controller runs the episodes itself
    check_alive: Callable[[], None]  # raises naming the worker when one has died
    episodes: RemoteEpisodes | None = None  # when rollout workers run the episodes
    servers: ServerPool | None = None  # drops or restarts a dead server
    proxy_host: str = "127.0.0.1"  # a plug-in workflow's proxy here: the loopback address of the run's family
    proxy_ports: PortAllocator | None = None  # ... and the controller's port slot
    critics: Critics | None = None  # RPC to every critic rank (algorithm.advantage=gae)
    startup: Startup | None = None  # the run's start-up phases, logged when training begins


class Loop:
    def __init__(self, cfg: Config, workers: Workers, tokenizer: Any, train_rows: list, eval_rows: list, run_dir):
        self.cfg, self.w, self.tokenizer, self.run_dir = cfg, workers, tokenizer, run_dir
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.counters = {"reward_errors": 0, "groups_dropped": 0, "groups_equal_reward": 0}
        self.rows = TrainingRows(train_rows, cfg.run.seed)  # the rollout's rows, from a position checkpoints keep
        check = _check_with_critic if workers.critics is not None else check_checkpoint
        self.checkpoints = Checkpoints(run_dir.checkpoints, cfg.checkpoint.keep, check_trainers=check)
        self.executor: RolloutExecutor | None = None  # while the loop runs
        self.accuracy_before = self.accuracy = 0.0  # held-out accuracy before step 1, and the latest measured
        self.progress: Callable[[int, dict[str, Any]], None] = lambda step, metrics: None
        self.preempt: PreemptionGuard | None = None  # notes Slurm's preemption or time-limit signal
        self._workflow: Any = None  # this process's workflow: its episodes, and a plug-in's held-out evaluation
        self._reward_model_waited = 0.0  # the reward pool's reward_model_wait_s at the last step's metrics
        self._eval_rewards: RewardPool | None = None  # eval.reward_fn's pool, started at the first evaluation
        log_unmeasured(cfg.algorithm)

    async def run(self, sync: WeightSync) -> dict[str, Any]:
        """Train until run.max_steps or eval.stop_at_accuracy; return the summary."""
        main = asyncio.create_task(self._train(sync), name="loop")
        watchdog = asyncio.create_task(self._watch(), name="watchdog")
        try:
            done, _ = await asyncio.wait({main, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (main, watchdog):
                task.cancel()
            await asyncio.gather(main, watchdog, return_exceptions=True)
            await close_workflow(self._workflow)  # a plug-in's proxy stops listening
            if self._eval_rewards is not None:
                self._eval_rewards.close()
        finished = done.pop()
        if finished.exception() is not None and not isinstance(finished.exception(), Preempted):
            await self._blame_dead_worker(finished.exception())
        return finished.result()

    async def _blame_dead_worker(self, error: BaseException, grace_s: float = 5.0) -> None:
        """An RPC or HTTP failure is often the echo of a worker that died: name that worker if there is one.

        Its group may take a moment to notice (torchrun reaps the rest of its ranks first).
        """
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                self.w.check_alive()
            except Exception as dead:
                raise dead from error
            await asyncio.sleep(0.2)

    async def _watch(self, period_s: float = 1.0) -> None:
        """Every ``period_s``: is every worker alive? Restarted servers rejoin in a task of their own (loading the
        weights may take long, and waits for a weight sync): the watchdog never waits on it, only raises what it
        raised."""
        rejoin: asyncio.Task | None = None
        try:
            while True:
                self.w.check_alive()
                if self.w.servers is not None:
                    if rejoin is not None and rejoin.done():
                        rejoin.result()  # a restarted server that never registered fails the run
                        rejoin = None
                    if rejoin is None:
                        rejoin = asyncio.create_task(self.w.servers.rejoin(), name="rejoin")
                await asyncio.sleep(period_s)
        finally:
            if rejoin is not None:
                rejoin.cancel()
                await asyncio.gather(rejoin, return_exceptions=True)

    async def _train(self, sync: WeightSync) -> dict[str, Any]:
        cfg, start = self.cfg, time.monotonic()
        executor = self.executor = self._executor()
        restored = await self._begin(executor, sync)
        done = restored.step if restored else 0
        startup_s = self._startup_done("checkpoint loaded" if restored else "first evaluation")
        # under recover.mode=auto an interrupted run may have logged steps past ``done``: they run again
        keep_until = done if cfg.recover.mode == "auto" else None
        name = f"{cfg.run.experiment}/{cfg.run.trial}"
        metrics_log = MetricsLog(self.run_dir.path, keep_until, cfg.metrics, run_name=name, run_config=cfg)
        executor.start()
        step, metrics = done, {}
        try:
            for step in range(done + 1, cfg.run.max_steps + 1):
                metrics = await self._step(step, executor, sync)
                if self._eval_due(step):
                    self.accuracy = metrics["eval_accuracy"] = await self.evaluate()
                if cfg.export.every_steps and step % cfg.export.every_steps == 0:
                    metrics["time_export_s"] = await self._export(step)
                state = None
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                    state, metrics["time_checkpoint_s"] = await self._save_checkpoint(step)
                # the step's line is on disk before its checkpoint is complete: a resume from that checkpoint keeps
                # the lines up to its step, so a kill between the two must not find the checkpoint without the line
                metrics_log.log(step, metrics)
                if state is not None:
                    metrics_log.sync()
                    self.checkpoints.publish(state)
                self.progress(step, metrics)
                if self.preempt is not None and self.preempt.requested:
                    metrics_log.sync()  # the step may be checkpointed now
                    await self._stop_for_preemption(step, checkpointed="time_checkpoint_s" in metrics)
                target = cfg.eval.stop_at_accuracy
                if target and "eval_accuracy" in metrics and self.accuracy >= target:
                    log.info("held-out accuracy %.3f reached eval.stop_at_accuracy at step %d", self.accuracy, step)
                    break
        finally:
            await executor.close()
            metrics_log.close()
        if "eval_accuracy" not in metrics:
            self.accuracy = await self.evaluate()
        summary = {
            "steps": step,
            "wall_s": round(time.monotonic() - start, 2),
            "eval_accuracy_before": self.accuracy_before,
            "eval_accuracy_after": self.accuracy,
        }
        if startup_s is not None:
            summary["startup_s"] = startup_s
        return {**summary, "resumed_from_step": done} if restored else summary

    def _startup_done(self, phase: str) -> float | None:
        """The start-up's last phase marked and its line logged; its seconds for the summary (None when the loop
        runs without the job, as in unit tests)."""
        startup = self.w.startup
        if startup is None:
            return None
        startup.mark(phase)
        log.info("%s", startup.line())
        return round(startup.seconds(), 2)

    async def _begin(self, executor: RolloutExecutor, sync: WeightSync) -> ControllerState | None:
        """Resume from the newest usable checkpoint (recover.mode=auto), or measure the accuracy before step 1."""
        state = await self._load_newest_checkpoint()
        if state is None:
            self.accuracy_before = self.accuracy = await self.evaluate()
            log.info("held-out accuracy before training: %.3f", self.accuracy_before)
            return None
        # before any rollout, so every token's version (and staleness) goes on from the checkpoint's
        await sync.push(state.weight_version)
        executor.restore(state.weight_version, batches_trained=state.step, rejected=state.rejected_by_cause)
        self.rows.restore(state.rows)
        self.counters.update(state.counters)
        set_rng_states(state.rng)
        self.accuracy_before, self.accuracy = state.eval_accuracy_before, state.eval_accuracy_last
        todo = f"training steps {state.step + 1}..{self.cfg.run.max_steps}"
        if state.step >= self.cfg.run.max_steps:  # a requeued run whose last step was checkpointed
            todo = f"nothing left to train (run.max_steps={self.cfg.run.max_steps})"
        log.info("resumed at step %d (weights version %d); %s", state.step, state.weight_version, todo)
        return state

    async def _load_newest_checkpoint(self) -> ControllerState | None:
        """The trainers load the newest checkpoint that is whole and loads; one they fail to load is set aside and
        the one before is tried. None: nothing to resume from. Raises when loads failed and none succeeded: the
        trainers' state is then neither a checkpoint's nor the initial one."""
        from hpcrl.rpc.client import RemoteError

        failed = []
        for path, state in resume_candidates(self.cfg.recover.mode, self.checkpoints):
            who = "the trainers"
            try:
                await self.w.trainers.load_checkpoint(path)
                if self.w.critics is not None:
                    who = "the critic"
                    await self.w.critics.load_checkpoint(path / CRITIC_DIR)
            except RemoteError as e:
                failed.append(path.name)
                self.checkpoints.set_aside(path, f"{who} could not load it: {str(e).splitlines()[0]}")
                continue
            log.info("recover.mode=auto: resuming from %s (step %d)", path, state.step)
            return state
        if failed:
            raise RuntimeError(
                f"the trainers failed to load every checkpoint ({', '.join(failed)}, set aside as .broken in "
                f"{self.checkpoints.directory}; their logs say why): start a new run.trial, or fix and rename one back"
            )
        if self.cfg.recover.mode == "auto":
            log.info("recover.mode=auto: no complete checkpoint in %s; starting at step 1", self.checkpoints.directory)
        return None

    async def _step(self, step: int, executor: RolloutExecutor, sync: WeightSync) -> dict[str, Any]:
        cfg, version = self.cfg, step - 1  # the weights trained at this step are version step - 1
        t0 = time.monotonic()
        groups = await executor.next_batch()
        t1 = time.monotonic()
        metrics: dict[str, Any] = rollout_stats(groups, version)
        every = cfg.metrics.samples_every_steps
        if every and step % every == 0:
            metrics["samples"] = sample_rows(groups, cfg.metrics.samples_per_log)  # MetricsLog: samples.jsonl
        rewards = [sample.reward for group in groups for sample in group.samples]  # to_sequences' order
        export_to = await sync.export_path(step)  # disk sync: the last train call writes the servers' weights
        sizes = [len(group.samples) for group in groups]  # to_sequences' sequences, group by group
        results = await self._train_on(to_sequences(groups, cfg.algorithm), sizes, rewards, metrics, step, export_to)
        t2 = time.monotonic()
        await self._push(sync, step, exported=bool(export_to))
        executor.set_version(step)  # starts the groups the new version lets start
        t3 = time.monotonic()
        await asyncio.sleep(0)  # one turn of the event loop: their requests go out before the step's bookkeeping
        trained = sorted({k for r in results for k in r} - {"step"})  # loss, grad_norm, clip_frac, kl, ...
        metrics.update({k: statistics.fmean(r[k] for r in results if k in r) for k in trained})
        metrics.update(self.counters)
        metrics.update(
            groups_rejected=executor.rejected_total,
            groups_failed=executor.rejected["failed"],
            groups_too_long=executor.rejected["too_long"],
            **self._server_counts(),
            time_rollout_wait_s=round(t1 - t0, 4),
            time_train_s=round(t2 - t1, 4),
            time_sync_s=round(t3 - t2, 4),
            time_step_s=round(t3 - t0, 4),
        )
        metrics.update(self._reward_model_time())
        return metrics

    def _reward_model_time(self) -> dict[str, float]:
        """``time_reward_model_s``: the seconds since the last step's metrics when a request to the reward model's
        servers was in flight from this process (the rollout workers' are not seen here; none without a reward
        model). Under asynchronous rollout they overlap the step's other parts."""
        if not self.cfg.allocation.reward_model.workers or self.w.episodes is not None:
            return {}
        waited = self.w.rewards.reward_model_wait_s
        since, self._reward_model_waited = waited - self._reward_model_waited, waited
        return {"time_reward_model_s": round(since, 4)}

    async def _train_on(
        self,
        sequences: list[SequenceData],
        group_sizes: list[int],
        rewards: list[float],
        metrics: dict[str, Any],
        step: int,
        export_to: str = "",
    ) -> list[dict[str, float]]:
        """``algorithm.updates_per_batch`` optimizer updates, each on its own disjoint part of the batch
        (``_minibatches``: whole groups, ``group_sizes`` sequences each in batch order); with a critic, its update on
        the same part at the same time (its metrics prefixed ``critic_``). The last update writes the servers'
        weights to ``export_to`` when it is not "".

        First, at once: decoupled PPO's proximal logprobs (the policy before this step's first update, taken once
        for the whole batch, so every part's ratio is against the same policy) and the critic's values, from which
        GAE gives every token's advantage and return (``apply_gae``; its metrics go into ``metrics``)."""
        trainers, critics = self.w.trainers, self.w.critics
        await asyncio.gather(self._proximal(sequences, metrics), self._gae(sequences, rewards, metrics))
        rejected = mask_rejected(sequences, self.cfg.algorithm.off_policy)  # after GAE, which reads the masks
        metrics.update(rejected)
        rejecting = bool(rejected)
        results = []
        seed = derive_seed(self.cfg.run.seed, "minibatches", step)
        chunks = _minibatches(sequences, group_sizes, self.cfg.algorithm, seed)
        for i, chunk in enumerate(chunks):
            export = export_to if i == len(chunks) - 1 else ""
            if rejecting and not any(any(s.loss_mask) for s in chunk):
                # masked importance sampling rejected every token of this part: no update (an optimizer step on
                # no data would still move the weights by its momentum and decay)
                self.counters["updates_skipped"] = self.counters.get("updates_skipped", 0) + 1
                if export:
                    await trainers.export_for_servers(export)
                continue
            if critics is None:
                results.append(await trainers.train_step(shard(chunk, trainers.world_size), export))
                continue
            actor, critic = await asyncio.gather(
                trainers.train_step(shard(chunk, trainers.world_size), export),
                critics.train_step(shard(chunk, critics.world_size)),
            )
            results.append({**actor, **{f"critic_{k}": critic[k] for k in CRITIC_METRICS if k in critic}})
        first_update_mismatch(results, keep=not any(k.startswith("mismatch_") for k in metrics))
        return results

    async def _proximal(self, sequences: list[SequenceData], metrics: dict[str, Any]) -> None:
        """The trainers' logprobs of the batch before this step's first update, where the loss needs them: decoupled
        PPO and the off-policy corrections as every sequence's ``prox_logprobs``, ``algorithm.behaviour_logprobs=
        recompute`` as its ``old_logprobs`` (the servers were asked for none); and their gap to the servers'
        behaviour logprobs where there are some (``mismatch_*``, ``controller/mismatch.py``)."""
        algorithm = self.cfg.algorithm
        recompute = algorithm.behaviour_logprobs == "recompute"
        if not (needs_proximal(algorithm) or recompute):
            return
        trainers = self.w.trainers
        shards = shard(sequences, trainers.world_size)
        trainer = [lp for logprobs in await trainers.compute_logprobs(shards) for lp in logprobs]
        ordered = [seq for part in shards for seq in part]
        metrics.update(batch_mismatch(ordered, trainer))
        for seq, lp in zip(ordered, trainer, strict=True):
            if recompute:
                seq.old_logprobs = lp
            else:
                seq.prox_logprobs = lp

    async def _gae(self, sequences: list[SequenceData], rewards: list[float], metrics: dict[str, Any]) -> None:
        """With a critic: its values of the batch, then GAE's per-token advantages, returns and old values."""
        critics = self.w.critics
        if critics is None:
            return
        shards = shard(sequences, critics.world_size)
        values = {id(seq): v for part, vs in zip(shards, await critics.values(shards), strict=True)
                  for seq, v in zip(part, vs, strict=True)}  # fmt: skip
        stats = apply_gae(sequences, rewards, [values[id(seq)] for seq in sequences], self.cfg.algorithm)
        metrics.update({k: v for k, v in stats.items() if math.isfinite(v)})  # explained variance: NaN if undefined

    def _server_counts(self) -> dict[str, int]:
        pool = self.w.servers
        if pool is None:
            return {}
        return {"servers_lost": pool.lost, "servers_restarted": pool.restarts, "servers_joined": pool.joins}

    def _executor(self) -> RolloutExecutor:
        cfg = self.cfg
        if self.w.episodes is not None:  # rollout workers run the workflow and the reward
            episode = self._remote_episode
        else:
            workflow = self.workflow()
            episode = lambda row: workflow.run(  # noqa: E731
                row["prompt"], row["answer"], seed=self._seed(row), columns=row.get("columns")
            )
        return RolloutExecutor(
            episode,
            self.rows,
            batch_size=cfg.rollout.prompts_per_step,
            max_concurrent=cfg.rollout.max_concurrent,
            max_staleness=cfg.rollout.max_staleness,
            reject=self._reject,
            classify=_episode_error_cause,
            max_rejected_in_a_row=cfg.rollout.max_rejected_in_a_row,
        )

    def _seed(self, row: dict[str, Any]) -> int | None:
        """The episode's seed, which every request's sampling seed derives from: run.seed and the row's draw."""
        return derive_seed(self.cfg.run.seed, "draw", row["draw"]) if "draw" in row else None

    async def _remote_episode(self, row: dict[str, str]) -> Group:
        """One episode on a rollout worker; one lost with its worker runs again on the others (none left: fail)."""
        from hpcrl.rollout.remote import RolloutWorkerLost

        while True:
            try:
                return await self.w.episodes.run(row, seed=self._seed(row))
            except RolloutWorkerLost as e:
                self.counters["episodes_lost"] = self.counters.get("episodes_lost", 0) + 1
                log.warning("%s; running the episode again on the remaining rollout workers", e)

    def _reject(self, group: Group) -> tuple[str, str] | None:
        """Apply reward.on_error and DAPO's filter: why the group is not trained on (a cause of the executor's
        ``CAUSES``, and what happened), or None; failed rewards are scored 0 under on_error=zero."""
        failed = [s for s in group.samples if s.reward_error is not None]
        if failed:
            self.counters["reward_errors"] += len(failed)
            policy = self.cfg.reward.on_error
            if policy == "fail":
                raise RewardError(f"{len(failed)} reward call(s) failed for {group.prompt!r}: {failed[0].reward_error}")
            if policy == "drop":
                self.counters["groups_dropped"] += 1
                return "reward_error", f"{len(failed)} of {len(group.samples)} failed: {failed[0].reward_error}"
            for sample in failed:
                sample.reward = 0.0
        rewards = {s.reward for s in group.samples}
        if self.cfg.algorithm.drop_equal_reward_groups and len(rewards) == 1:
            self.counters["groups_equal_reward"] += 1
            return "equal_rewards", f"every reward {rewards.pop()} for {group.prompt!r}"
        return None

    async def _push(self, sync: WeightSync, step: int, exported: bool) -> None:
        """The weight sync; one that failed because a server died goes again once that server has left the pool.
        ``exported``: the step's train call wrote the servers' weights (``WeightSync.export_path``)."""
        from hpcrl.inference.client import InferenceError

        servers = len(self.w.client.addresses)
        try:
            await sync.push(step, exported=exported)
        except InferenceError:
            if not await self._server_left(servers):
                raise
            log.warning("the weight sync of step %d failed on a server that has died; again without it", step)
            await sync.push(step, exported=exported)

    async def _server_left(self, servers: int, grace_s: float = 10.0) -> bool:
        """Whether a server leaves the pool within ``grace_s`` (its worker may take a moment to exit)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.w.check_alive()  # drops or restarts a dead server (inference.on_server_exit), or raises naming it
            if len(self.w.client.addresses) < servers:
                return True
            await asyncio.sleep(0.2)
        return False

    async def _stop_for_preemption(self, step: int, checkpointed: bool) -> None:
        """Slurm's warning came (preempt.py): make sure ``step`` is checkpointed, then stop the run."""
        if not checkpointed:
            await self._checkpoint(step)
        raise Preempted(step, str(self.checkpoints.step_dir(step)))

    async def _checkpoint(self, step: int) -> float:
        """Everything needed to go on after ``step`` (between steps), complete: ``_save_checkpoint``, then the
        marker. Only where ``step``'s metrics line is already written (preemption); the loop publishes itself."""
        state, seconds = await self._save_checkpoint(step)
        self.checkpoints.publish(state)
        return seconds

    async def _export(self, step: int) -> float:
        """export.every_steps: the model as trained to ``step``, in Hugging Face layout, in exports/step_NNNNNN/."""
        start = time.monotonic()
        await self.w.trainers.export(self.run_dir.path / "exports" / f"step_{step:06d}")
        return round(time.monotonic() - start, 4)

    async def _save_checkpoint(self, step: int) -> tuple[ControllerState, float]:
        """The controller's state, taken at once (the rollout goes on meanwhile), and the trainers' sharded state
        written; the checkpoint is complete once ``Checkpoints.publish`` writes the state as its marker."""
        start = time.monotonic()
        state = self._state(step)
        await self.w.trainers.save_checkpoint(self.checkpoints.step_dir(step))
        if self.w.critics is not None:  # after the trainers: their save renames the step directory into place
            await self.w.critics.save_checkpoint(self.checkpoints.step_dir(step) / CRITIC_DIR)
        return state, round(time.monotonic() - start, 4)

    def _state(self, step: int) -> ControllerState:
        executor = self.executor
        assert executor is not None, "a checkpoint is taken while the loop runs"
        return ControllerState(
            step=step,
            weight_version=executor.version,
            rows=self.rows.state(executor.unbatched_rows()),
            counters=dict(self.counters),
            groups_rejected=executor.rejected_total,
            rejected_by_cause=dict(executor.rejected),
            eval_accuracy_before=self.accuracy_before,
            eval_accuracy_last=self.accuracy,
            rng=rng_states(),
        )

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return step == self.cfg.run.max_steps or (every > 0 and step % every == 0)

    def workflow(self) -> Any:
        """The workflow this process runs (``make_workflow``), built once."""
        if self._workflow is None:
            w = self.w
            self._workflow = make_workflow(
                self.cfg, w.client, self.tokenizer, w.rewards, self.resumed, host=w.proxy_host, ports=w.proxy_ports
            )
        return self._workflow

    async def evaluate(self) -> float:
        """Held-out accuracy: greedy completions of the prompts, or for a plug-in workflow the episode's own final
        reward, one greedy run per row (here, even when rollout workers run the training episodes)."""
        if is_plugin(self.cfg.workflow.name):
            return await self.workflow().accuracy(self.eval_rows)
        if self._eval_rewards is None:
            self._eval_rewards = eval_reward_pool(self.cfg, self.w.rewards)
        rewards = self._eval_rewards or self.w.rewards
        return await greedy_accuracy(
            self.w.client, self.tokenizer, self.eval_rows, rewards, self.cfg.rollout.max_new_tokens
        )


CRITIC_DIR = "critic"  # a checkpoint's critic state: <step dir>/critic/, written like the trainers'
CRITIC_METRICS = ("loss", "grad_norm", "lr", "clip_frac")  # the critic's train step's, reported as critic_<name>


def _check_with_critic(path) -> str | None:
    """What is wrong with a checkpoint's trainer part or its critic part, or None."""
    problem = check_checkpoint(path)
    critic = None if problem else check_checkpoint(path / CRITIC_DIR)
    return problem or (f"the critic's part: {critic}" if critic else None)


def _minibatches(items: list, group_sizes: list[int], algorithm: AlgorithmConfig, seed: int | None) -> list[list]:
    """``algorithm.updates_per_batch`` disjoint parts of ``items``, each of whole groups in batch order
    (``group_sizes[g]`` items each, the parts' group counts differing by at most one); with
    ``algorithm.shuffle_minibatches``, parts of a copy shuffled by ``seed`` instead (a sample's group mates may land
    in other parts), as TRL splits its generation batch and PPO implementations draw their minibatches. Fewer
    groups (or samples) than parts is a ValueError: the config check refuses such a run before it starts."""
    parts, shuffled = algorithm.updates_per_batch, algorithm.shuffle_minibatches
    if sum(group_sizes) != len(items):
        raise ValueError(f"{len(items)} sequences, but the groups hold {sum(group_sizes)}")
    count, unit = (len(items), "samples") if shuffled else (len(group_sizes), "groups")
    if count < parts:
        raise ValueError(f"algorithm.updates_per_batch={parts} minibatches cannot be made of {count} {unit}")
    if shuffled:
        items = list(items)
        random.Random(seed).shuffle(items)
        bounds = _even_bounds(len(items), parts)
    else:
        starts = list(itertools.accumulate(group_sizes, initial=0))
        bounds = [starts[g] for g in _even_bounds(len(group_sizes), parts)]
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def _even_bounds(n: int, parts: int) -> list[int]:
    """Where ``parts`` near-equal slices of ``n`` things start, and ``n``: their sizes differ by at most one."""
    return [i * n // parts for i in range(parts + 1)]


def _episode_error_cause(error: BaseException) -> str | None:
    """The rejection cause of an episode error that fails one group, not the run; None: it fails the run.

    A request whose prompt plus ``max_new_tokens`` does not fit the model's context (``ContextLengthError``,
    raised by the client before sending, here or on a rollout worker): ``too_long``. A server that kept failing
    a request through the client's bounded retries, or an episode that raised on a rollout worker: ``failed``.
    A dead server or trainer is the watchdog's to report; many rejections in a row fail the run
    (RolloutExecutor)."""
    from hpcrl.inference.client import ContextLengthError, InferenceError
    from hpcrl.rollout.remote import RolloutWorkerError

    remote_type = getattr(error.__cause__, "error_type", None)  # a rollout worker's error, by its type's name
    if isinstance(error, ContextLengthError) or remote_type == ContextLengthError.__name__:
        return "too_long"
    if isinstance(error, (InferenceError, RolloutWorkerError)):
        return "failed"
    return None
