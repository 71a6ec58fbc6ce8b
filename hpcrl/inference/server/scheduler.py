"""Continuous batching for the CPU server.

Requests wait in a queue; the scheduler takes up to ``max_running`` of them (after waiting
``batch_wait_ms`` for more to arrive) and decodes them together, one shared forward pass per step,
dropping rows as they finish and admitting waiting requests between steps (their prompts are
prefilled, then their rows and KV cache join the running batch). Between steps it also honours pauses
(``abort`` ends every running request with ``finish_reason.type == "abort"``; ``in_place`` holds them
until continue) and per-request aborts.

With LoRA, a batch holds at most ``max_loras_per_batch`` distinct adapters, the base model counting as one
(SGLang's ``--max-loras-per-batch``): a request whose adapter would make one more waits, and the requests
behind it that fit go first, as SGLang's scheduler skips it.

Weight updates never change weights under a running batch: they wait for it to finish, unless
generation is paused in place, in which case they apply between two steps (as SGLang does). No batch
starts, and no request joins one, while an update waits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hpcrl.inference.server.runner import BatchState, ModelRunner
from hpcrl.inference.server.sampling import BatchSampler, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    done: asyncio.Future
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    abort_requested: bool = False
    weight_version: str = ""
    started: float = field(default_factory=time.monotonic)
    lora: str | None = None  # the LoRA adapter's id in the model (``lora_model.py``); None = the base model


class Scheduler:
    def __init__(self, runner: ModelRunner, max_running: int = 256, batch_wait_ms: float = 2.0):
        self.runner = runner
        self.max_running = max_running
        self.max_loras_per_batch = 1 << 30  # distinct adapters in a batch, the base counting as one (lora.py sets it)
        self.batch_wait_s = batch_wait_ms / 1000
        self.weight_version = "default"
        self.pause_mode: str | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self._work = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._changed = asyncio.Condition()  # batch ended, or pause state changed
        self._batch_active = False
        self._updates_waiting = 0
        self._torch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        # set by the event loop when it has something for the decode loop to do between steps
        self._interrupt = threading.Event()

    # ---------------------------------------------------------------- requests
    async def generate(self, sequences: list[Sequence]) -> None:
        """Queue sequences and wait until every one has finished."""
        for seq in sequences:
            if seq.params.max_new_tokens == 0:
                self._finish(seq, {"type": "length", "length": 0})
            else:
                self.waiting.append(seq)
        self._work.set()
        self._interrupt.set()
        await asyncio.gather(*(seq.done for seq in sequences))

    def abort(self, rid: str | None = None) -> int:
        """Abort every request when rid is None; else, as SGLang 0.5.23 does, nothing unless a request with
        exactly ``rid`` is in flight (its tokenizer manager forwards only a rid it knows: ``abort_request``),
        and then every request whose rid starts with ``rid`` (its scheduler's match). Returns how many."""
        if rid is not None and rid not in self.rids_in_flight():
            return 0
        hit = 0
        for seq in [*self.waiting, *self.running.values()]:
            if rid is None or seq.rid.startswith(rid):
                seq.abort_requested, hit = True, hit + 1
        self._interrupt.set()
        for seq in [s for s in self.waiting if s.abort_requested]:
            self.waiting.remove(seq)
            self._finish(seq, {"type": "abort", "message": "aborted by /abort_request"})
        return hit

    def rids_in_flight(self) -> set[str]:
        """The rids of the requests queued or running."""
        return {seq.rid for seq in [*self.waiting, *self.running.values()]}

    def idle(self) -> bool:
        """Nothing runs and nothing waits (while paused, waiting requests do not count): SGLang's condition
        for flushing its cache."""
        return not self.running and not self._batch_active and (not self.waiting or self.pause_mode is not None)

    async def pause(self, mode: str) -> None:
        self.pause_mode = mode
        self._resumed.clear()
        self._interrupt.set()
        if mode == "abort":
            for seq in list(self.waiting):
                self._finish(seq, {"type": "abort", "message": "generation paused"})
            self.waiting.clear()
        await self._notify()
        if mode == "abort":  # as SGLang, answer once the running batch has ended with its aborts
            async with self._changed:
                await self._changed.wait_for(lambda: not self._batch_active)

    async def resume(self) -> None:
        self.pause_mode = None
        self._resumed.set()
        self._work.set()
        await self._notify()

    async def wait_resumed(self) -> None:
        """Return once generation is not paused (at once when it is not)."""
        await self._resumed.wait()

    async def update_weights(self, apply: Callable[[], None], version: str | None) -> None:
        """Run ``apply`` on the torch thread once no batch decodes on the old weights (see module doc)."""
        self._updates_waiting += 1
        self._interrupt.set()
        try:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: not self._batch_active or self.pause_mode in ("in_place", "retract")
                )
            await self._call(apply)
            if version is not None:
                self.weight_version = version
        finally:
            self._updates_waiting -= 1
            self._work.set()

    async def call_torch(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the torch thread (serialised with decoding)."""
        return await self._call(fn)

    # ---------------------------------------------------------------- the loop
    async def run_forever(self) -> None:
        while True:
            if not self.waiting or self.pause_mode or self._updates_waiting:
                self._work.clear()
                await self._work.wait()
                continue
            if self.batch_wait_s and len(self.waiting) < self.max_running:
                await asyncio.sleep(self.batch_wait_s)
            await self._run_batch(self._take(self.max_running, set()))

    async def _run_batch(self, batch: list[Sequence]) -> None:
        self._batch_active = True
        try:
            state = await self._prefill(batch)
            while state.seq_ids:
                if self.pause_mode == "abort":
                    self._end_all(state, {"type": "abort", "message": "generation paused"})
                    break
                if self.pause_mode:
                    await self._resumed.wait()
                    continue
                self._drop_aborted(state)
                if state.seq_ids:
                    await self._admit(state)
                    self._interrupt.clear()
                    self._retire(state, await self._call(lambda: self._decode_run(state)))
        except Exception as e:
            log.exception("a batch of %d sequences failed", len(self.running))
            for seq in self.running.values():
                if not seq.done.done():
                    seq.done.set_exception(e)
        finally:
            self.running.clear()
            self._batch_active = False
            await self._notify()

    async def _prefill(self, batch: list[Sequence]) -> BatchState:
        ids = [next(self._ids) for _ in batch]
        self.running.update(zip(ids, batch, strict=True))
        sampler = BatchSampler.of([s.params for s in batch], self.runner.vocab_size)
        prompts = [s.prompt_ids for s in batch]
        adapters = [s.lora for s in batch]
        state = await self._call(lambda: self.runner.prefill(ids, prompts, sampler, adapters))
        self._retire(state, self._append(state))
        return state

    async def _admit(self, state: BatchState) -> None:
        """Continuous batching: prefill waiting requests and add them to the running batch."""
        room = self.max_running - len(state.seq_ids)
        if not self.waiting or room <= 0 or self._updates_waiting:
            return
        taken = self._take(room, set(state.adapters))
        if not taken:
            return
        joining = await self._prefill(taken)
        if joining.seq_ids:
            await self._call(lambda: ModelRunner.merge(state, joining))

    def _take(self, room: int, adapters: set[str | None]) -> list[Sequence]:
        """Up to ``room`` waiting sequences, in order, skipping those whose adapter would make the batch's
        distinct adapters (``adapters``, updated) more than ``max_loras_per_batch``."""
        taken: list[Sequence] = []
        kept: deque[Sequence] = deque()
        while self.waiting and len(taken) < room:
            seq = self.waiting.popleft()
            if seq.lora in adapters or len(adapters) < self.max_loras_per_batch:
                adapters.add(seq.lora)
                taken.append(seq)
            else:
                kept.append(seq)
        self.waiting.extendleft(reversed(kept))
        return taken

    def _decode_run(self, state: BatchState, max_steps: int = 256) -> dict[int, dict[str, Any]]:
        """On the torch thread: decode until a row finishes or the event loop has work; return finished rows.

        Staying on the torch thread for many steps saves a thread hand-off per step, which costs as much
        as a decode step of a tiny model.
        """
        for _ in range(max_steps):
            self.runner.decode(state)
            finished = self._append(state)
            if finished or self._interrupt.is_set():
                return finished
        return {}

    def _append(self, state: BatchState) -> dict[int, dict[str, Any]]:
        """Append each row's new token to its sequence; return {row: finish reason} of rows that stop."""
        finished = {}
        tokens, logprobs = state.tokens.tolist(), state.logprobs.tolist()
        for row, sid in enumerate(state.seq_ids):
            seq = self.running[sid]
            seq.output_ids.append(tokens[row])
            seq.logprobs.append(logprobs[row])
            reason = self._stop_reason(seq)
            if reason is not None:
                finished[row] = reason
        return finished

    def _retire(self, state: BatchState, finished: dict[int, dict[str, Any]]) -> None:
        """Finish the rows that stopped and drop them from the batch."""
        if not finished:
            return
        for row, reason in finished.items():
            self._finish(self.running.pop(state.seq_ids[row]), reason)
        keep = [row for row in range(len(state.seq_ids)) if row not in finished]
        if keep:
            ModelRunner.keep_rows(state, keep)
        else:
            state.seq_ids = []

    def _stop_reason(self, seq: Sequence) -> dict[str, Any] | None:
        """Why a sequence stops after its last token, in SGLang's order (``Req.update_finish_state``): a stop
        string, then a stop token (none with ``ignore_eos``, which also turns off ``stop_token_ids``), then
        the length."""
        token, p = seq.output_ids[-1], seq.params
        if p.stop:
            text = self.runner.tokenizer.decode(seq.output_ids)
            for s in p.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if not p.ignore_eos and (token in p.stop_token_ids or token in self.runner.eos_ids):
            return {"type": "stop", "matched": token}
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(seq.output_ids)}
        if len(seq.prompt_ids) + len(seq.output_ids) >= self.runner.max_positions:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _drop_aborted(self, state: BatchState) -> None:
        rows = [r for r, sid in enumerate(state.seq_ids) if not self.running[sid].abort_requested]
        if len(rows) == len(state.seq_ids):
            return
        for sid in state.seq_ids:
            if self.running[sid].abort_requested:
                self._finish(self.running.pop(sid), {"type": "abort", "message": "aborted by /abort_request"})
        if rows:
            ModelRunner.keep_rows(state, rows)
        else:
            state.seq_ids = []

    def _end_all(self, state: BatchState, reason: dict[str, Any]) -> None:
        for sid in state.seq_ids:
            self._finish(self.running.pop(sid), reason)
        state.seq_ids = []

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        seq.weight_version = self.weight_version
        if not seq.done.done():
            seq.done.set_result(None)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._torch, fn)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
