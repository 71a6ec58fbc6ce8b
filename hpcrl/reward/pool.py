"""A pool of reward processes that scores completions with a timeout per call.

    with RewardPool("hpcrl.reward.builtin:mod10", workers=2, timeout_s=10.0) as pool:
        outcomes = await pool.score([(prompt, completion, answer), ...])   # one RewardOutcome per item
    with RewardPool(["pkg.rewards:fmt", "pkg.rewards:exact"], weights=[0.2, 1.0]) as pool:   # reward.fn as a list
        outcomes = await pool.score([(prompt, completion, answer, {"column": value}), ...])  # value and parts

An item is ``(prompt, completion, answer)``, or with a fourth element the row's columns the functions take
by name (``hpcrl.reward.registry``). A list of functions scores an item with each, in one call: its value
is their weighted sum, its ``parts`` each function's own value by name.

Each worker is a subprocess, ``python -m hpcrl.reward.worker INDEX SPEC ...`` (see ``worker.py`` for its
wire), that imports the reward functions itself: only the spec strings, and then JSON values (the items,
the rewards), cross the process boundary, so a lambda or a ``__main__`` function cannot be shipped. The specs
are also resolved here, before any worker starts, so a bad spec fails at once with the import error. Workers see
this process's ``sys.path`` (through PYTHONPATH) and run in their own session, so a Ctrl-C at the
terminal reaches only this process, which ends them.

``score`` splits the items into batches (a few per worker, at most ``max_batch`` items each) on one
queue. Every worker has a driver thread here that takes a batch, writes it in one line and reads one
reply per item; the event loop only awaits futures, so it is never blocked.

Timeouts: a call is timed from the moment the worker could start it (the batch was sent, or the
previous item's reply arrived). When ``timeout_s`` passes without a reply, that item fails as "timed
out after T s", the worker's process tree is ended by PID (SIGTERM, then SIGKILL after a short grace,
through ``hpcrl.launch.process``) and a fresh worker, started by the same driver, takes the batch's
remaining items. A worker that dies mid-call (``os._exit``, a segfault, the OOM killer) fails only the
item it was scoring and is replaced the same way; one found dead between batches fails no item. Other
workers carry on meanwhile.

A function marked ``@in_process`` (``hpcrl.reward.registry``; the builtin ``mod10`` is), or a list of them only,
starts no worker:
``score`` calls it in this process, item by item, with no timeout, as the mark promises it needs none.

Model rewards (``async def f(..., reward_model)``, ``hpcrl.reward.registry``) are scored here too, in the
running event loop, never in a worker: every (item, model reward) call of one ``score`` is started at once, so the
calls a group makes in the same tick go to the reward-model servers as one batched request
(``hpcrl.reward.model_client``); each is bounded by ``timeout_s``, and a timeout or an exception fails the item as
a worker's would. In a ``reward.fn`` list the other functions go to the workers (or are called here when marked),
concurrently, and the values are weighed together. ``use_reward_model(addresses)`` gives the pool the servers; the
client is made in the loop that first needs it (made again in a later loop) and closed by ``close``. A model reward
scored before ``use_reward_model`` fails its item saying so. ``reward_model_wait_s`` is the time spent waiting on
the reward model (seconds, cumulative).

``close`` (or leaving the ``with`` block) fails batches not yet scored, ends every worker by PID and
joins the driver threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.launch.process import IGNORE_USR2, Child, stop_all
from hpcrl.reward.model_client import RewardModel, RewardModelClient
from hpcrl.reward.model_link import RewardModelLink
from hpcrl.reward.outcome import RewardOutcome
from hpcrl.reward.registry import Reward, RewardFns, specs_of, to_reward
from hpcrl.reward.worker import MAX_ERROR_CHARS, score_one

__all__ = ["RewardOutcome", "RewardPool", "WorkerStartError"]

log = logging.getLogger(__name__)

Item = tuple[str, str, str, Mapping[str, Any]]  # (prompt, completion, answer, the row's columns); or the first three

_KILL_GRACE_S = 2.0  # a timed-out worker's grace between SIGTERM and SIGKILL
_CLOSE_JOIN_S = 10.0  # how long close() waits for each driver thread after the workers are ended
_CLOSED = "the reward pool was closed before this item was scored"


class WorkerStartError(RuntimeError):
    """A reward worker did not come up (it failed to resolve the spec, died, or missed its deadline)."""


@dataclass
class _Batch:
    items: list[Item]
    future: Future = field(default_factory=Future)  # list[RewardOutcome], one per item


class RewardPool:
    """Reward processes for one reward function (or a weighted list); ``with`` starts them and ends them by PID."""

    def __init__(
        self,
        spec: str | Sequence[str],  # "package.module:function", or a list of them, imported in each worker
        workers: int = 2,  # reward processes
        timeout_s: float = 10.0,  # seconds one call (every function of a list) may take before it fails
        start_timeout_s: float = 60.0,  # seconds a worker gets to import the reward and report ready
        max_batch: int = 64,  # the most items sent to a worker in one message
        weights: Sequence[float] = (),  # a list's weight of each function; () = 1 each
        judge: Any = None,  # reward.judge (a JudgeConfig) for model rewards; None: its defaults
        model_kind: str = "generative",  # reward.model.kind, handed to model rewards
    ) -> None:
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"RewardPool: workers must be an integer >= 1, got {workers!r}")
        for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not value > 0:
                raise ValueError(f"RewardPool: {name} must be seconds > 0, got {value!r}")
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"RewardPool: max_batch must be an integer >= 1, got {max_batch!r}")
        # a bad spec fails here, with the import error, before any process starts
        self.fns = RewardFns.resolve(spec, weights)
        self._here = self.fns.in_process  # every function marked @in_process or a model reward: no workers
        self._plain = RewardFns(  # what the workers (or this process, for marked ones) score; model rewards aside
            tuple(r for r in self.fns.rewards if not r.uses_reward_model), (), self.fns.listed
        )
        self.spec = spec if isinstance(spec, str) else " + ".join(specs_of(spec))  # for messages
        self._link = RewardModelLink(timeout_s, judge, model_kind)  # the reward-model servers, for model rewards
        self.workers = workers
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_batch = max_batch
        self.restarts = 0  # workers replaced after a timeout or a death
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders worker starts against close()
        self._closed = False
        self._started = False
        specs = [r.spec for r in self._plain.rewards]
        self._procs = [] if self._here else [_Worker(specs, self.spec, i) for i in range(workers)]
        self._drivers: list[threading.Thread] = []

    # ---- lifecycle

    def start(self) -> RewardPool:
        """Start every worker and wait until all are ready; ``WorkerStartError`` if one is not."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool: start() after close(); make a new pool")
            if self._started:
                return self
            self._started = True
            if self._here and self.fns.model_rewards:
                log.info(
                    "reward function %s asks the reward model (and is otherwise marked @in_process): scored in this "
                    "process's event loop, so reward.workers=%d does not apply",
                    *(self.spec, self.workers),
                )
                return self
            if self._here:
                log.info(
                    "reward function %s is marked @in_process: scored in this process, so reward.workers=%d and "
                    "reward.timeout_s=%g do not apply",
                    *(self.spec, self.workers, self.timeout_s),
                )
                return self
            for proc in self._procs:
                proc.spawn()
        try:
            deadline = time.monotonic() + self.start_timeout_s
            for proc in self._procs:  # they start side by side; this only collects their handshakes
                proc.handshake(deadline)
        except BaseException:
            self.close()
            raise
        for proc in self._procs:
            thread = threading.Thread(target=self._drive, args=(proc,), name=f"reward-driver-{proc.index}", daemon=True)
            thread.start()
            self._drivers.append(thread)
        log.info("reward pool of %d workers for %s ready (pids %s)", self.workers, self.spec, self.pids())
        return self

    def close(self) -> None:
        """Fail what is not yet scored, end every worker by PID and join the driver threads. Idempotent."""
        with self._lock:
            self._closed = True
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                break
            if batch is not None:
                _finish(batch, [RewardOutcome(error=_CLOSED)] * len(batch.items))
        for _ in self._drivers:
            self._queue.put(None)
        # Ending the processes is enough to free the drivers: one blocked on a reply sees its pipe end.
        # Their pipes are theirs to close, so they are only dropped once the drivers are joined.
        self._stop_workers(forget=False)
        for thread in self._drivers:
            thread.join(_CLOSE_JOIN_S)
            if thread.is_alive():
                log.error("reward driver %s did not finish %g s after its worker ended", thread.name, _CLOSE_JOIN_S)
        self._drivers.clear()
        self._stop_workers(forget=True)  # again: a driver may have been starting a replacement
        self._link.close()

    def pids(self) -> list[int]:
        """The PIDs of the worker processes now running (they change when a worker is replaced)."""
        return [p.pid for p in self._procs if p.pid is not None]

    @classmethod
    def for_config(cls, reward: Any) -> RewardPool:
        """The pool of a run's ``reward`` section (``RewardConfig``): reward.fn, reward.weights, workers, timeout,
        and for model rewards reward.judge and reward.model.kind."""
        return cls(
            reward.fn,
            reward.workers,
            reward.timeout_s,
            weights=reward.weights,
            judge=reward.judge,
            model_kind=reward.model.kind,
        )

    # ---- the reward model

    def use_reward_model(self, addresses: list[str]) -> None:
        """Give the pool the reward-model servers (``host:port``, ready) that its model rewards ask; ``ValueError``
        for none or a malformed address. Called again (servers replaced), the next score uses the new ones."""
        self._link.use(addresses)

    def sibling(self, spec: str | Sequence[str]) -> RewardPool:
        """A started pool of another reward (``eval.reward_fn``, best-of-N's ``workflow.verifier``) with this pool's
        workers, timeout, judge settings and reward-model servers, so that a model reward scores there too."""
        link = self._link
        pool = RewardPool(spec, self.workers, self.timeout_s, judge=link.judge, model_kind=link.kind).start()
        if link.addresses:
            pool.use_reward_model(link.addresses)
        return pool

    @property
    def reward_model_client(self) -> RewardModelClient | None:
        """The reward-model client now in use (its ``requests``, ``prompts``, ``wait_s``); None before the first
        model reward is scored, and after ``close``."""
        return self._link.client

    @property
    def reward_model_wait_s(self) -> float:
        """Seconds spent waiting on the reward model, cumulative over the pool's clients (0 with none)."""
        return self._link.wait_s

    def __enter__(self) -> RewardPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- scoring

    async def score(self, items: Sequence[Item | tuple[str, str, str]]) -> list[RewardOutcome]:
        """Score ``(prompt, completion, answer[, columns])`` items; one outcome per item, in order. Never blocks the
        loop (a function marked ``@in_process`` is called right here: it returns in microseconds); model rewards are
        awaited here, every item's at once (the module docstring)."""
        if not self.fns.model_rewards:
            return [self._weighed(outcome) for outcome in await self._score_plain(items)]
        checked = self._checked(items)
        plain, model = await asyncio.gather(self._score_plain(checked), self._score_model(checked))
        return [self._weighed(self._merged(p, m)) for p, m in zip(plain, model, strict=True)]

    async def _score_plain(self, items: Sequence[Item | tuple[str, str, str]]) -> list[_Values | RewardOutcome]:
        """The functions other than model rewards: each item's values (in their order), or its failure."""
        if not self._plain.rewards:
            return [_Values([]) for _ in self._checked(items)]
        if self._here:
            return [_outcome(score_one(self._plain, *item)) for item in self._checked(items)]
        batches = self._submit(items)
        results = await asyncio.gather(*(asyncio.wrap_future(b.future) for b in batches))
        return [self._named(outcome) for result in results for outcome in result]

    async def _score_model(self, items: list[Item]) -> list[list[float] | RewardOutcome]:
        """The model rewards of every item, all started at once (so a group's calls share batched requests)."""
        rewards = self.fns.model_rewards
        try:
            reward_model = self._link.reward_model()
        except RuntimeError as e:
            return [RewardOutcome(error=f"{rewards[0].name}: {e}") for _ in items]
        calls = [self._call_model(r, item, reward_model) for item in items for r in rewards]
        done = await asyncio.gather(*calls)
        per_item = [done[i : i + len(rewards)] for i in range(0, len(done), len(rewards))]
        return [next((o for o in outs if isinstance(o, RewardOutcome)), outs) for outs in per_item]  # type: ignore[misc]

    async def _call_model(self, reward: Reward, item: Item, reward_model: RewardModel) -> float | RewardOutcome:
        """One model reward of one item, bounded by timeout_s; a failure as a failed RewardOutcome naming it."""
        named = f"{reward.name}: " if self.fns.listed else ""
        try:
            value = await asyncio.wait_for(reward(*item, reward_model=reward_model), self.timeout_s)
        except TimeoutError:
            return RewardOutcome(error=f"{named}timed out after {self.timeout_s:g} s", timed_out=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return RewardOutcome(error=_cut(f"{named}raised {type(e).__name__}: {e}"))
        try:
            return to_reward(value)
        except (TypeError, ValueError) as e:
            return RewardOutcome(error=_cut(f"{named}{e}"))

    def _merged(self, plain: _Values | RewardOutcome, model: list[float] | RewardOutcome) -> _Values | RewardOutcome:
        """One item's values in reward.fn's order, or its first failure (the workers' before the model's)."""
        if isinstance(plain, RewardOutcome):
            return plain
        if isinstance(model, RewardOutcome):
            return model
        plain_values, model_values = iter(plain.values), iter(model)
        return _Values([next(model_values if r.uses_reward_model else plain_values) for r in self.fns.rewards])

    def _named(self, outcome: _Values | RewardOutcome) -> _Values | RewardOutcome:
        """A worker's failure of a list's one function besides model rewards, named as the worker could not (it
        resolves that function alone, not as a list)."""
        lone = self.fns.listed and len(self._plain.rewards) == 1
        if lone and isinstance(outcome, RewardOutcome) and outcome.error and outcome.error != _CLOSED:
            return dataclasses.replace(outcome, error=f"{self._plain.rewards[0].name}: {outcome.error}")
        return outcome

    def score_sync(self, items: Sequence[Item | tuple[str, str, str]]) -> list[RewardOutcome]:
        """``score`` for code without an event loop: blocks this thread until every item is scored. Model rewards
        need the loop their client lives in: ``RuntimeError``."""
        if self.fns.model_rewards:
            raise RuntimeError(f"RewardPool.score_sync: {self.spec} asks the reward model; await score() instead")
        if self._here:
            return self._score_here(items)
        return [self._weighed(outcome) for b in self._submit(items) for outcome in b.future.result()]

    def _score_here(self, items: Sequence[Item | tuple[str, str, str]]) -> list[RewardOutcome]:
        checked = self._checked(items)
        return [self._weighed(_outcome(score_one(self._plain, *item))) for item in checked]

    def _weighed(self, outcome: _Values | RewardOutcome) -> RewardOutcome:
        """A call's outcome: each function's value weighed into the reward, and kept as a part for a list."""
        if isinstance(outcome, RewardOutcome):
            return outcome
        value, parts = self.fns.combine(outcome.values)
        return RewardOutcome(value=value, parts=parts)

    def _checked(self, items: Sequence[Item | tuple[str, str, str]]) -> list[Item]:
        if not self._started or self._closed:
            raise RuntimeError("RewardPool: score() needs a started, open pool; use `with RewardPool(...) as pool:`")
        return [_check_item(i, item) for i, item in enumerate(items)]

    def _submit(self, items: Sequence[Item | tuple[str, str, str]]) -> list[_Batch]:
        checked = self._checked(items)
        size = max(1, min(self.max_batch, math.ceil(len(checked) / (self.workers * 4))))
        batches = [_Batch(checked[i : i + size]) for i in range(0, len(checked), size)]
        with self._lock:  # close() sets _closed under the lock, then fails what is queued
            if self._closed:
                raise RuntimeError("RewardPool: score() after close()")
            for batch in batches:
                self._queue.put(batch)
        return batches

    # ---- the driver thread of one worker

    def _drive(self, proc: _Worker) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                _finish(batch, self._run(proc, batch.items))
            except BaseException as e:  # a bug here must not leave a caller waiting forever
                log.exception("reward driver %d failed", proc.index)
                if not batch.future.done():
                    batch.future.set_exception(e)

    def _run(self, proc: _Worker, items: list[Item]) -> list[_Values | RewardOutcome]:
        outcomes: list[_Values | RewardOutcome] = []
        while len(outcomes) < len(items) and not self._closed:
            if not proc.running:
                try:
                    self._restart(proc)
                except WorkerStartError as e:
                    error = _CLOSED if self._closed else f"no reward worker: {e}"
                    return outcomes + [RewardOutcome(error=error)] * (len(items) - len(outcomes))
            scored = proc.run(items[len(outcomes) :], self.timeout_s)
            if self._closed and not proc.running:
                scored = scored[:-1]  # its worker was ended by close(), not by the reward
            outcomes += scored
        return outcomes + [RewardOutcome(error=_CLOSED)] * (len(items) - len(outcomes))

    def _restart(self, proc: _Worker) -> None:
        with self._lock:
            if self._closed:
                raise WorkerStartError("the reward pool is closed")
            proc.spawn()
            self.restarts += 1
        proc.handshake(time.monotonic() + self.start_timeout_s)

    def _stop_workers(self, forget: bool) -> None:
        with self._lock:
            children = [p.child for p in self._procs if p.child is not None]
        stop_all(children, _KILL_GRACE_S)
        if forget:
            for proc in self._procs:
                proc.forget()


class _Worker:
    """The parent's end of one worker process: its pipes and its ``Child`` handle."""

    def __init__(self, specs: list[str], spec: str, index: int):
        self.specs, self.spec = specs, spec  # what it imports; how messages name it
        self.index = index
        self.child: Child | None = None
        self.running = False  # spawned, handshake done, and neither dead nor killed since
        self._popen: subprocess.Popen | None = None
        self._poll = select.poll()
        self._buf = bytearray()

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None and self.child.alive() else None

    def spawn(self) -> None:
        self.forget()
        # SIGUSR2 (Slurm's warning) is the controller's to act on: ignored by a shell that then execs the worker,
        # as every child of process.spawn is (IGNORE_USR2 says why not a preexec_fn)
        cmd = [*IGNORE_USR2, sys.executable, "-m", "hpcrl.reward.worker", str(self.index), *self.specs]
        # Workers import what this process can import: the same sys.path, "" meaning our cwd.
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,
            bufsize=0,
        )
        # stderr is this process's own (a worker's log lines carry [reward:INDEX]), so no log file
        self.child = Child(f"reward worker {self.index}", popen, Path(os.devnull))
        self._popen = popen
        self._buf.clear()
        self._poll = select.poll()
        assert popen.stdout is not None
        self._poll.register(popen.stdout.fileno(), select.POLLIN)

    def handshake(self, deadline: float) -> None:
        try:
            message = self._read(deadline)
        except _Gone as e:
            self.stop()
            raise WorkerStartError(f"reward worker {self.index} for {self.spec!r} {e} before it was ready") from None
        if message is None:
            self.stop()
            raise WorkerStartError(f"reward worker {self.index} for {self.spec!r} was not ready in time")
        if "fatal" in message:
            self.stop()
            raise WorkerStartError(f"reward worker {self.index}: {message['fatal']}")
        self.running = True

    def run(self, items: list[Item], timeout_s: float) -> list[_Values | RewardOutcome]:
        """Score ``items`` in order; stop early (``running`` turns False) at a timeout or a death."""
        assert self._popen is not None and self._popen.stdin is not None
        if self._popen.poll() is not None:  # it ended while idle: no item of this batch is to blame
            log.warning("reward worker %d %s while idle; starting another", self.index, self._exit_text())
            self.stop()
            return []
        outcomes: list[_Values | RewardOutcome] = []
        with contextlib.suppress(BrokenPipeError):  # it died while idle; the reader below tells how
            self._popen.stdin.write(json.dumps(items).encode() + b"\n")
        while len(outcomes) < len(items):
            try:
                message = self._read(time.monotonic() + timeout_s)
            except _Gone as e:
                log.warning("reward worker %d %s while scoring; starting another", self.index, e)
                self.stop()
                return [*outcomes, RewardOutcome(error=f"reward worker {e} while scoring this item")]
            if message is None:
                log.warning("a reward call ran past %g s: ending worker %d (pid %s)", timeout_s, self.index, self.pid)
                error = f"timed out after {timeout_s:g} s (reward worker pid {self.pid} killed and replaced)"
                self.stop()
                return [*outcomes, RewardOutcome(error=error, timed_out=True)]
            outcomes.append(_outcome(message))
        return outcomes

    def stop(self) -> None:
        if self.child is not None:
            stop_all([self.child], _KILL_GRACE_S)
        self.forget()

    def forget(self) -> None:
        """Drop the handle of a worker that has ended (closing our ends of its pipes)."""
        self.running = False
        if self._popen is not None:
            for pipe in (self._popen.stdin, self._popen.stdout):
                if pipe is not None:
                    pipe.close()
            if self._popen.poll() is None:  # still running: keep the handle so close() can end it
                return
        self._popen = None
        self.child = None

    def _read(self, deadline: float) -> dict[str, Any] | None:
        """The next message; None if ``deadline`` passes first; ``_Gone`` at the end of the pipe."""
        assert self._popen is not None and self._popen.stdout is not None
        fd = self._popen.stdout.fileno()
        while (end := self._buf.find(b"\n")) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(max(1, math.ceil(left * 1000))):
                if time.monotonic() >= deadline:
                    return None
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _Gone(self._exit_text())
            self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise _Gone(f"(pid {self._popen.pid}) broke the wire protocol with {line[:200]!r}")
        return message

    def _exit_text(self) -> str:
        assert self._popen is not None
        pid = self._popen.pid
        try:
            code = self._popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return f"(pid {pid}) closed its output"
        if code >= 0:
            return f"(pid {pid}) exited with code {code}"
        try:
            return f"(pid {pid}) was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"(pid {pid}) was killed by signal {-code}"


class _Gone(Exception):
    """The worker's output ended: it exited or was killed."""


def _check_item(index: int, item: Any) -> Item:
    ok = isinstance(item, (tuple, list)) and len(item) in (3, 4) and all(isinstance(s, str) for s in item[:3])
    if not ok:
        got = type(item).__name__ if not isinstance(item, (tuple, list)) else [type(s).__name__ for s in item]
        raise TypeError(
            f"RewardPool.score: items[{index}] must be (prompt, completion, answer) strings and optionally the row's "
            f"columns, got {got}"
        )
    columns = item[3] if len(item) == 4 else {}
    if not (isinstance(columns, Mapping) and all(isinstance(k, str) for k in columns)):
        raise TypeError(f"RewardPool.score: items[{index}][3] must be the row's columns by name, got {columns!r}")
    return (item[0], item[1], item[2], dict(columns))


@dataclass(frozen=True)
class _Values:
    """A call that succeeded: each function's value, weighed by the pool (``RewardPool._weighed``)."""

    values: list[float]


def _outcome(message: dict[str, Any]) -> _Values | RewardOutcome:
    """``score_one``'s ``{"v": [each function's reward]}``, or a failed RewardOutcome of ``{"e": what went wrong}``."""
    if "v" in message:
        return _Values([float(v) for v in message["v"]])
    return RewardOutcome(error=str(message.get("e", message)))


def _cut(text: str) -> str:
    """An error text cut as a worker cuts its own (``worker.MAX_ERROR_CHARS``)."""
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _finish(batch: _Batch, outcomes: Sequence[_Values | RewardOutcome]) -> None:
    if not batch.future.done():
        batch.future.set_result(outcomes)
