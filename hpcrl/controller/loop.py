"""One RL run's loop: rollout -> train step -> weight sync -> eval -> checkpoint -> metrics, to the budget or target.

Waits: the loop waits on the rollout executor for a batch of accepted groups, then on the trainers
(every rank, one RPC each), then on the weight sync (servers paused, weights pushed, resumed). A
watchdog checks every second that every worker process is alive; if one dies, the loop is cancelled
and the watchdog's error (naming the worker) is raised.

Checkpoints and resuming (``recovery.py``): every ``checkpoint.every_steps`` steps the loop saves the
controller's state and the trainers' after the step's eval. With ``recover.mode=auto`` it starts from the
newest complete checkpoint: the trainers load it and the servers get its weights before the first rollout.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpcrl.config.schema import Config
from hpcrl.controller.batch import rollout_stats, shard, to_sequences
from hpcrl.controller.evaluate import greedy_accuracy
from hpcrl.controller.metrics import MetricsLog
from hpcrl.controller.preempt import Preempted, PreemptionGuard
from hpcrl.controller.recovery import Checkpoints, ControllerState, find_checkpoint, rng_states, set_rng_states
from hpcrl.controller.rows import TrainingRows
from hpcrl.controller.weights import WeightSync
from hpcrl.inference.client import InferenceClient
from hpcrl.reward.outcome import RewardError
from hpcrl.rollout.executor import RolloutExecutor
from hpcrl.rollout.workflows import make_workflow
from hpcrl.rollout.workflows.base import Group

if TYPE_CHECKING:  # types only: importing these here would add the reward pool and RPC to every loop import
    from hpcrl.controller.servers import ServerPool
    from hpcrl.controller.trainers import Trainers
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


class Loop:
    def __init__(self, cfg: Config, workers: Workers, tokenizer: Any, train_rows: list, eval_rows: list, run_dir):
        self.cfg, self.w, self.tokenizer, self.run_dir = cfg, workers, tokenizer, run_dir
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.counters = {"reward_errors": 0, "groups_dropped": 0, "groups_equal_reward": 0}
        self.rows = TrainingRows(train_rows, cfg.run.seed)  # the rollout's rows, from a position checkpoints keep
        self.checkpoints = Checkpoints(run_dir.checkpoints, cfg.checkpoint.keep)
        self.executor: RolloutExecutor | None = None  # while the loop runs
        self.accuracy_before = self.accuracy = 0.0  # held-out accuracy before step 1, and the latest measured
        self.progress: Callable[[int, dict[str, Any]], None] = lambda step, metrics: None
        self.preempt: PreemptionGuard | None = None  # notes Slurm's preemption or time-limit signal

    async def run(self, sync: WeightSync) -> dict[str, Any]:
        """Train until run.max_steps or eval.stop_at_accuracy; return the summary."""
        main = asyncio.create_task(self._train(sync), name="loop")
        watchdog = asyncio.create_task(self._watch(), name="watchdog")
        done, _ = await asyncio.wait({main, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        for task in (main, watchdog):
            task.cancel()
        await asyncio.gather(main, watchdog, return_exceptions=True)
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

    async def _watch(self) -> None:
        while True:
            self.w.check_alive()
            if self.w.servers is not None:
                await self.w.servers.rejoin()  # restarted servers that are ready come back
            await asyncio.sleep(1.0)

    async def _train(self, sync: WeightSync) -> dict[str, Any]:
        cfg, start = self.cfg, time.monotonic()
        executor = self.executor = self._executor()
        restored = await self._begin(executor, sync)
        done = restored.step if restored else 0
        # under recover.mode=auto an interrupted run may have logged steps past ``done``: they run again
        metrics_log = MetricsLog(self.run_dir.path, keep_until=done if cfg.recover.mode == "auto" else None)
        executor.start()
        step, metrics = done, {}
        try:
            for step in range(done + 1, cfg.run.max_steps + 1):
                metrics = await self._step(step, executor, sync)
                if self._eval_due(step):
                    self.accuracy = metrics["eval_accuracy"] = await self.evaluate()
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                    metrics["time_checkpoint_s"] = await self._checkpoint(step)
                metrics_log.log(step, metrics)
                self.progress(step, metrics)
                if self.preempt is not None and self.preempt.requested:
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
        return {**summary, "resumed_from_step": done} if restored else summary

    async def _begin(self, executor: RolloutExecutor, sync: WeightSync) -> ControllerState | None:
        """Resume from the newest complete checkpoint (recover.mode=auto), or measure the accuracy before step 1."""
        found = find_checkpoint(self.cfg.recover.mode, self.checkpoints)
        if found is None:
            self.accuracy_before = self.accuracy = await self.evaluate()
            log.info("held-out accuracy before training: %.3f", self.accuracy_before)
            return None
        path, state = found
        await self.w.trainers.load_checkpoint(path)
        # before any rollout, so every token's version (and staleness) goes on from the checkpoint's
        await sync.push(state.weight_version)
        executor.restore(state.weight_version, batches_trained=state.step, rejected_total=state.groups_rejected)
        self.rows.restore(state.rows)
        self.counters.update(state.counters)
        set_rng_states(state.rng)
        self.accuracy_before, self.accuracy = state.eval_accuracy_before, state.eval_accuracy_last
        log.info(
            "resumed at step %d (weights version %d); training steps %d..%d",
            state.step,
            state.weight_version,
            state.step + 1,
            self.cfg.run.max_steps,
        )
        return state

    async def _step(self, step: int, executor: RolloutExecutor, sync: WeightSync) -> dict[str, Any]:
        cfg, version = self.cfg, step - 1  # the weights trained at this step are version step - 1
        t0 = time.monotonic()
        groups = await executor.next_batch()
        t1 = time.monotonic()
        metrics: dict[str, Any] = rollout_stats(groups, version)
        sequences = to_sequences(groups, cfg.algorithm)
        chunks = _split(sequences, cfg.algorithm.updates_per_batch)
        results = [await self.w.trainers.train_step(shard(c, self.w.trainers.world_size)) for c in chunks]
        t2 = time.monotonic()
        await self._push(sync, step)
        executor.set_version(step)
        t3 = time.monotonic()
        trained = sorted({k for r in results for k in r} - {"step"})  # loss, grad_norm, clip_frac, kl, ...
        metrics.update({k: statistics.fmean(r[k] for r in results if k in r) for k in trained})
        metrics.update(self.counters)
        metrics.update(
            groups_rejected=executor.rejected_total,
            groups_failed=executor.failed_total,
            **self._server_counts(),
            time_rollout_wait_s=round(t1 - t0, 4),
            time_train_s=round(t2 - t1, 4),
            time_sync_s=round(t3 - t2, 4),
            time_step_s=round(t3 - t0, 4),
        )
        return metrics

    def _server_counts(self) -> dict[str, int]:
        pool = self.w.servers
        return {"servers_lost": pool.lost, "servers_restarted": pool.restarts} if pool is not None else {}

    def _executor(self) -> RolloutExecutor:
        cfg = self.cfg
        if self.w.episodes is not None:  # rollout workers run the workflow and the reward
            episode = self._remote_episode
        else:
            workflow = make_workflow(cfg, self.w.client, self.tokenizer, self.w.rewards, self.resumed)
            episode = lambda row: workflow.run(row["prompt"], row["answer"])  # noqa: E731
        return RolloutExecutor(
            episode,
            self.rows,
            batch_size=cfg.rollout.prompts_per_step,
            max_concurrent=cfg.rollout.max_concurrent,
            max_staleness=cfg.rollout.max_staleness,
            accept=self._accept,
            tolerated=_episode_errors(),
        )

    async def _remote_episode(self, row: dict[str, str]) -> Group:
        """One episode on a rollout worker; one lost with its worker runs again on the others (none left: fail)."""
        from hpcrl.rollout.remote import RolloutWorkerLost

        while True:
            try:
                return await self.w.episodes.run(row)
            except RolloutWorkerLost as e:
                self.counters["episodes_lost"] = self.counters.get("episodes_lost", 0) + 1
                log.warning("%s; running the episode again on the remaining rollout workers", e)

    def _accept(self, group: Group) -> bool:
        """Apply reward.on_error and DAPO's filter; score failed rewards 0 under on_error=zero."""
        failed = [s for s in group.samples if s.reward_error is not None]
        if failed:
            self.counters["reward_errors"] += len(failed)
            policy = self.cfg.reward.on_error
            if policy == "fail":
                raise RewardError(f"{len(failed)} reward call(s) failed for {group.prompt!r}: {failed[0].reward_error}")
            if policy == "drop":
                self.counters["groups_dropped"] += 1
                return False
            for sample in failed:
                sample.reward = 0.0
        rewards = {s.reward for s in group.samples}
        if self.cfg.algorithm.drop_equal_reward_groups and len(rewards) == 1:
            self.counters["groups_equal_reward"] += 1
            return False
        return True

    async def _push(self, sync: WeightSync, step: int) -> None:
        """The weight sync; one that failed because a server died goes again once that server has left the pool."""
        from hpcrl.inference.client import InferenceError

        servers = len(self.w.client.addresses)
        try:
            await sync.push(step)
        except InferenceError:
            if not await self._server_left(servers):
                raise
            log.warning("the weight sync of step %d failed on a server that has died; again without it", step)
            await sync.push(step)

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
        """Everything needed to go on after ``step`` (between steps): the controller's state, taken at once (the
        rollout goes on meanwhile), the trainers' sharded state, then the marker that completes the checkpoint."""
        start = time.monotonic()
        state = self._state(step)
        await self.w.trainers.save_checkpoint(self.checkpoints.step_dir(step))
        self.checkpoints.publish(state)
        return round(time.monotonic() - start, 4)

    def _state(self, step: int) -> ControllerState:
        executor = self.executor
        assert executor is not None, "a checkpoint is taken while the loop runs"
        return ControllerState(
            step=step,
            weight_version=executor.version,
            rows=self.rows.state(executor.unbatched_rows()),
            counters=dict(self.counters),
            groups_rejected=executor.rejected_total,
            eval_accuracy_before=self.accuracy_before,
            eval_accuracy_last=self.accuracy,
            rng=rng_states(),
        )

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return step == self.cfg.run.max_steps or (every > 0 and step % every == 0)

    async def evaluate(self) -> float:
        return await greedy_accuracy(
            self.w.client, self.tokenizer, self.eval_rows, self.w.rewards, self.cfg.rollout.max_new_tokens
        )


def _split(items: list, parts: int) -> list[list]:
    size = -(-len(items) // parts)
    return [items[i : i + size] for i in range(0, len(items), size)]


def _episode_errors() -> tuple[type[BaseException], ...]:
    """Errors that fail one episode's group, not the run: a server that kept failing a request through the
    client's bounded retries, or an episode that raised on a rollout worker. A dead server or trainer is the
    watchdog's to report; many failures in a row fail the run (RolloutExecutor)."""
    from hpcrl.inference.client import InferenceError
    from hpcrl.rollout.remote import RolloutWorkerError

    return (InferenceError, RolloutWorkerError)
