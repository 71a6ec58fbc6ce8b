"""The loop's own logic, with fake workers: what it sends the trainers, the order of a step's record and its
checkpoint, and a watchdog that never waits on a reloading server. The real processes are in test_job.py."""

import asyncio
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hpcrl.config.schema import Config
from hpcrl.controller import metrics
from hpcrl.controller.loop import Loop, Workers, _minibatches
from hpcrl.controller.metrics import read_metrics
from hpcrl.launch.base import WorkerFailed
from hpcrl.rpc.messages import SequenceData
from hpcrl.rundir import RunDir


def make_loop(tmp_path, cfg: Config | None = None, cls: type[Loop] = Loop, **workers) -> Loop:
    workers = {"client": None, "trainers": None, "rewards": None, "check_alive": lambda: None, **workers}
    run_dir = RunDir.create(tmp_path, "exp", "t")
    return cls(cfg or Config(), Workers(**workers), None, [{"prompt": "1+1=", "answer": "2"}], [], run_dir)


# ---------------------------------------------------------------- decoupled PPO's proximal policy


class PolicyTrainers:
    """Trainers whose policy is a number that each update raises by one: a logprob of the policy says which
    policy computed it. Records the proximal logprobs of every update."""

    world_size = 2

    def __init__(self):
        self.updates = 0
        self.prox_seen: list[list[float]] = []  # per train_step call, every token's proximal logprob

    async def compute_logprobs(self, shards):
        return [[[-1.0 - self.updates] * len(s.input_ids) for s in part] for part in shards]

    async def train_step(self, shards, export_to=""):
        self.prox_seen.append([lp for part in shards for s in part for lp in s.prox_logprobs])
        self.updates += 1
        return {"loss": 0.0}


def sequence(n: int) -> SequenceData:
    return SequenceData([3] * n, [0] + [1] * (n - 1), 1.0, [-0.5] * n, None, None, [-1] + [0] * (n - 1))


def test_decoupled_ppo_takes_the_proximal_policy_once_before_the_first_update(tmp_path):
    cfg = Config()
    cfg.algorithm = replace(cfg.algorithm, behavior_weight_cap=5.0, updates_per_batch=2)
    trainers = PolicyTrainers()
    loop = make_loop(tmp_path, cfg, trainers=trainers)
    asyncio.run(loop._train_on([sequence(n) for n in (3, 4, 5, 6)], [2, 2], [1.0] * 4, {}, step=1))
    assert trainers.updates == 2, "two disjoint parts of the batch, one update each"
    first, second = trainers.prox_seen
    assert set(first) == {-1.0}, "the policy before the first update"
    assert set(second) == {-1.0}, "the second part's proximal policy is still the one before the first update"
    assert len(first) + len(second) == 3 + 4 + 5 + 6


def test_without_the_decoupled_objective_no_proximal_logprobs_are_taken(tmp_path):
    trainers = PolicyTrainers()
    trainers.train_step = _record_none(trainers)
    loop = make_loop(tmp_path, trainers=trainers)
    asyncio.run(loop._train_on([sequence(3), sequence(4)], [1, 1], [1.0, 1.0], {}, step=1))
    assert trainers.prox_seen == [[None], [None]]


def _record_none(trainers):
    async def train_step(shards, export_to=""):
        trainers.prox_seen.append([s.prox_logprobs for part in shards for s in part])
        return {"loss": 0.0}

    return train_step


# ---------------------------------------------------------------- the minibatches of a step


class MinibatchTrainers:
    """Records, per update, which sequences it got (a sequence's advantage is its index in the batch)."""

    world_size = 2

    def __init__(self):
        self.parts: list[list[int]] = []
        self.exports: list[str] = []  # per update, where it wrote the servers' weights ("" = nowhere)

    async def train_step(self, shards, export_to=""):
        self.parts.append(sorted(int(s.advantage) for part in shards for s in part))
        self.exports.append(export_to)
        return {"loss": 0.0}


def minibatches(tmp_path, step: int, sizes=(8, 8, 8, 8), **algorithm) -> list[list[int]]:
    """The sequences (by index in the batch) of each update, for a batch of groups of ``sizes`` in batch order."""
    cfg = Config()
    cfg.algorithm = replace(cfg.algorithm, **{"updates_per_batch": 4, **algorithm})
    trainers = MinibatchTrainers()
    n = sum(sizes)
    batch = [replace(sequence(3), advantage=float(i)) for i in range(n)]
    loop = make_loop(tmp_path / f"{step}-{len(sizes)}", cfg, trainers=trainers)
    asyncio.run(loop._train_on(batch, list(sizes), [0.0] * n, {}, step))
    return trainers.parts


def test_minibatches_are_whole_groups_in_batch_order_unless_shuffled(tmp_path):
    assert minibatches(tmp_path, 1) == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    shuffled = minibatches(tmp_path, 1, shuffle_minibatches=True)
    assert sorted(i for part in shuffled for i in part) == list(range(32)), "disjoint, and every sample once"
    assert [len(part) for part in shuffled] == [8] * 4
    assert all(part != list(range(part[0], part[0] + 8)) for part in shuffled), "samples, not whole groups"
    # seeded by run.seed and the step: a resumed run splits a step's batch as the first run did
    assert minibatches(tmp_path, 1, shuffle_minibatches=True) == shuffled
    assert minibatches(tmp_path, 2, shuffle_minibatches=True) != shuffled


def test_minibatches_never_split_a_group_and_are_exactly_updates_per_batch():
    # before: parts of ceil(len / updates) sequences, so 3 groups of 4 in 2 updates cut group 1 in half, and
    # 9 sequences in 4 updates made 3 parts
    cfg = Config().algorithm
    three = [[1.0] * 4, [2.0] * 4, [3.0] * 4]
    flat = [x for g in three for x in g]
    assert _minibatches(flat, [4, 4, 4], replace(cfg, updates_per_batch=2), None) == [[1.0] * 4, [2.0] * 4 + [3.0] * 4]
    # groups of unequal sizes (a plug-in's): split by group count, each group whole
    sizes = [2, 5, 1, 3]
    items = [g for g, size in enumerate(sizes) for _ in range(size)]
    parts = _minibatches(items, sizes, replace(cfg, updates_per_batch=3), None)
    assert parts == [[0, 0], [1, 1, 1, 1, 1], [2, 3, 3, 3]]
    shuffled = _minibatches(list(range(9)), [3, 3, 3], replace(cfg, updates_per_batch=4, shuffle_minibatches=True), 7)
    assert [len(p) for p in shuffled] == [2, 2, 2, 3] and sorted(i for p in shuffled for i in p) == list(range(9))
    with pytest.raises(ValueError, match="updates_per_batch=4 minibatches cannot be made of 3 groups"):
        _minibatches(list(range(9)), [3, 3, 3], replace(cfg, updates_per_batch=4), None)


# ---------------------------------------------------------------- a step's record before its checkpoint


class FakeExecutor:
    version = 0

    def start(self):
        pass

    async def close(self):
        pass


class SpyCheckpoints:
    """Records which steps metrics.jsonl held when each checkpoint was marked complete."""

    def __init__(self, metrics_file):
        self.metrics_file, self.published = metrics_file, {}

    def publish(self, state):
        self.published[state.step] = [row["step"] for row in read_metrics(self.metrics_file)]


class RecordingLoop(Loop):
    """The loop's own ``_train`` with the steps, the eval and the trainers' part of a checkpoint faked."""

    async def _begin(self, executor, sync):
        return None

    def _executor(self):
        return FakeExecutor()

    async def _step(self, step, executor, sync):
        return {"loss": 1.0 / step}

    async def _save_checkpoint(self, step):
        return SimpleNamespace(step=step), 0.0

    async def evaluate(self):
        return 0.0


def test_a_steps_metrics_line_is_on_disk_before_its_checkpoint_is_complete(tmp_path):
    # the lost step 4 of HPCRL_KILL_SEED=58339: its checkpoint was complete before its line was written, so a
    # kill between the two left a checkpoint a resume cuts metrics.jsonl back to, without step 4's line
    cfg = Config()
    cfg.run.max_steps, cfg.checkpoint.every_steps = 6, 2
    cfg.eval = replace(cfg.eval, every_steps=0, stop_at_accuracy=0)
    loop = make_loop(tmp_path, cfg, cls=RecordingLoop)
    loop.checkpoints = SpyCheckpoints(loop.run_dir.path / "metrics.jsonl")
    asyncio.run(loop._train(sync=None))
    assert loop.checkpoints.published == {2: [1, 2], 4: [1, 2, 3, 4], 6: [1, 2, 3, 4, 5, 6]}


def test_metrics_jsonl_is_fsynced_before_each_checkpoint_is_complete_and_not_every_step(tmp_path, monkeypatch):
    # a node crash may lose what was never fsynced: a checkpoint's step must be on disk before its marker; the
    # steps between checkpoints need not be (a resume trains them again), and an fsync a step cost 0.4% of one
    events: list = []
    monkeypatch.setattr(metrics.os, "fsync", lambda fd: events.append(f"fsync {fsynced_name(fd)}"))
    cfg = Config()
    cfg.run.max_steps, cfg.checkpoint.every_steps = 6, 3
    cfg.eval = replace(cfg.eval, every_steps=0, stop_at_accuracy=0)
    loop = make_loop(tmp_path, cfg, cls=RecordingLoop)
    loop.checkpoints = SimpleNamespace(publish=lambda state: events.append(f"publish {state.step}"))
    asyncio.run(loop._train(sync=None))
    # the first time, the run directory too: its entry of the new file (before, a node crash could bring back a
    # complete checkpoint and no metrics.jsonl)
    assert events == ["fsync metrics.jsonl", "fsync t", "publish 3", "fsync metrics.jsonl", "publish 6"]


def test_a_resumes_rewritten_metrics_file_is_in_its_directory_on_disk_before_the_run_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    synced: list[str] = []
    monkeypatch.setattr(metrics.os, "fsync", lambda fd: synced.append(fsynced_name(fd)))
    assert metrics.cut_metrics(path, 1) == 1
    assert synced[-1] == tmp_path.name, "the rename over the old file: the directory fsynced after it"


def fsynced_name(fd: int) -> str:
    return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))


# ---------------------------------------------------------------- the watchdog and a reloading server


class ReloadingServers:
    """A restarted server whose weights take forever to load: ``rejoin`` never returns."""

    def __init__(self):
        self.rejoins_started = 0
        self.cancelled = False

    async def rejoin(self):
        self.rejoins_started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class TrainingForever(Loop):
    async def _train(self, sync):
        await asyncio.Event().wait()


def test_a_trainer_that_dies_while_a_server_reloads_fails_the_run_within_the_watchdogs_period(tmp_path):
    servers, died_at = ReloadingServers(), time.monotonic() + 1.5

    def check_alive():
        if time.monotonic() > died_at:
            raise WorkerFailed("trainer", 1, -9, "")

    loop = make_loop(tmp_path, cls=TrainingForever, check_alive=check_alive, servers=servers)
    with pytest.raises(WorkerFailed, match="trainer worker 1"):
        asyncio.run(asyncio.wait_for(loop.run(sync=None), 10))
    took = time.monotonic() - died_at
    assert took < 2.5, f"the watchdog noticed the dead trainer {took:.1f} s after it died (its period is 1 s)"
    assert servers.rejoins_started == 1, "one reload at a time, and the watchdog does not wait for it"
    assert servers.cancelled, "the reload under way ends with the run"


# ---------------------------------------------------------------- which episode errors reject only their group


def test_episode_errors_are_rejections_by_cause_or_fail_the_run():
    from hpcrl.controller.loop import _episode_error_cause
    from hpcrl.inference.client import ContextLengthError, InferenceError
    from hpcrl.rollout.remote import RolloutWorkerError
    from hpcrl.rpc.errors import RemoteError

    def on_a_rollout_worker(error_type: str) -> RolloutWorkerError:
        try:
            raise RolloutWorkerError(0, "h:1", f"failed the episode: {error_type}") from RemoteError(
                0, "h:1", "run_episode", error_type, "...", ""
            )
        except RolloutWorkerError as e:
            return e

    assert _episode_error_cause(ContextLengthError(500, 20, 512)) == "too_long"
    assert _episode_error_cause(on_a_rollout_worker("ContextLengthError")) == "too_long"
    assert _episode_error_cause(InferenceError("503 three times", server="h:2")) == "failed"
    assert _episode_error_cause(on_a_rollout_worker("ValueError")) == "failed"
    assert _episode_error_cause(KeyError("a bug")) is None, "anything else fails the run"


def test_only_the_steps_last_update_writes_the_servers_weights(tmp_path):
    cfg = Config()
    cfg.algorithm = replace(cfg.algorithm, updates_per_batch=3)
    trainers = MinibatchTrainers()
    batch = [replace(sequence(3), advantage=float(i)) for i in range(24)]
    loop = make_loop(tmp_path, cfg, trainers=trainers)
    asyncio.run(loop._train_on(batch, [8, 8, 8], [0.0] * 24, {}, 1, export_to="/w/v1"))
    assert trainers.exports == ["", "", "/w/v1"], "the weights the servers load are the step's last update's"
