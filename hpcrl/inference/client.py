"""The async client of a set of inference servers speaking SGLang's HTTP API (hpcrl's CPU server or SGLang).

    async with InferenceClient(["node1:30000", "[::1]:30001"]) as client:
        await client.wait_healthy(timeout_s=1200, check_alive=job.check_alive)
        results = await asyncio.gather(*(client.generate(ids, {"max_new_tokens": 256}) for ids in prompts))
        await client.pause()
        await client.update_weights_from_disk("/ckpt/step_10", weight_version=10)
        await client.resume()

Weight updates follow SGLang 0.5.23's contract: a distributed push is ``begin_weight_update`` -> one
``update_weights_from_distributed`` per bucket (tensors in the servers' dtype, a bounded number of bytes
each) -> ``end_weight_update``; every tensor-parallel rank of every server is a member of the weight-update
group (``tp_size``); weight-update calls have their own deadline (``weight_update_timeout_s``: a disk load
of a large model answers after minutes). A prompt whose length plus ``max_new_tokens`` exceeds
``context_length`` is never sent, nor one whose prompt reaches SGLang's margin of 6 tokens below it
(``context.fit``): ``ContextLengthError``, or with ``context_overflow="truncate"`` a shorter
``max_new_tokens`` when SGLang takes the prompt.

LoRA adapters (servers launched with ``--enable-lora``) are loaded by name on every server, from a directory
(``load_lora_adapter``) or from the trainer's tensors (``load_lora_adapter_from_tensors``, one copy per
tensor-parallel rank, ``client_lora``), and unloaded by name; a generate request names its adapter with
``lora_path`` (None: the base model). Like weight updates they are not retried and have the weight-update
deadline.

Generation goes to one server per request, picked by ``policy``: ``least_loaded`` (fewest requests in
flight from this client, ties broken round-robin) or ``round_robin``. The pool can change while requests
run: ``remove`` a dead server, ``add`` a restarted one. While it holds fewer than ``min_servers`` (1: while it is
empty, its only server restarting; an elastic fleet's ``allocation.server.min_workers``), new requests wait for
servers to join, at most ``no_server_timeout_s``; requests already sent go on. Control calls (pause, weight
updates, ...) go to every server concurrently. Retries and timeouts are described in ``client_http``;
the weight-group collectives are never retried, because a server that joins a collective twice waits for
a partner that is not coming.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from hpcrl.inference.client_http import HttpPool, InferenceError, fixed
from hpcrl.inference.client_lora import check_adapter_name, check_lora_update, checked_config, serialized_tensors
from hpcrl.inference.client_wire import ContextLengthError, GenerateResult, check_sampling, check_success, parse_result
from hpcrl.inference.context import fit, max_input_len
from hpcrl.inference.weight_layout import DEFAULT_GROUP, group_layout

__all__ = ["OVERFLOW", "POLICIES", "ContextLengthError", "GenerateResult", "InferenceClient", "InferenceError"]

logger = logging.getLogger(__name__)

POLICIES = ("least_loaded", "round_robin")
PAUSE_MODES = ("abort", "retract", "in_place")
OVERFLOW = ("drop", "truncate")  # what a prompt over the context length gets: ContextLengthError | fewer new tokens
HEALTH_PROBE_TIMEOUT_S = 25.0  # one GET /health (a one-token generation, 20 s at most on SGLang)


class InferenceClient:
    """Owns one aiohttp session; use it as ``async with InferenceClient(addresses) as client``."""

    def __init__(
        self,
        addresses: Sequence[str],
        request_timeout_s: float = 120.0,  # deadline of one HTTP request (one attempt)
        max_retries: int = 3,  # extra attempts after a connection error or HTTP 5xx
        backoff_s: float = 0.5,  # pause before the first retry; doubles on each further one
        policy: str = "least_loaded",  # least_loaded | round_robin: which server a generate request goes to
        max_connections: int = 1024,  # open connections at most, all servers together
        no_server_timeout_s: float = 600.0,  # how long a request waits while the pool is empty (a restart)
        *,
        tp_size: int = 1,  # tensor-parallel ranks of each server: each joins the weight-update group
        weight_update_timeout_s: float = 1800.0,  # deadline of one weight-update call (disk loads take minutes)
        context_length: int | None = None,  # the servers' context, checked by SGLang's rules (context.fit); None: not
        context_overflow: str = "drop",  # drop: ContextLengthError | truncate: fewer new tokens when possible
        adapter: str | None = None,  # the LoRA adapter a generate request names unless it names one (train.lora)
        min_servers: int = 1,  # below this many servers in the pool, new requests wait for servers to join
    ) -> None:
        _check_args(addresses, request_timeout_s, max_retries, backoff_s, policy, max_connections)
        if not no_server_timeout_s > 0:
            raise ValueError(f"no_server_timeout_s must be > 0, got {no_server_timeout_s}")
        _check_weight_args(tp_size, weight_update_timeout_s, context_length, context_overflow)
        self.addresses = list(addresses)
        self.policy = policy
        self.request_timeout_s = request_timeout_s
        self.tp_size = tp_size
        self.weight_update_timeout_s = weight_update_timeout_s
        self.context_length = context_length
        self.context_overflow = context_overflow
        self.adapter = None if adapter is None else check_adapter_name(adapter)
        self._http = HttpPool(
            self.addresses,
            timeout_s=request_timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_connections=max_connections,
        )
        self._cursor = 0  # where the next round-robin scan starts
        self.no_server_timeout_s = no_server_timeout_s
        if min_servers < 1:
            raise ValueError(f"min_servers must be >= 1, got {min_servers}")
        self.min_servers = min_servers
        self.answered: Counter[str] = Counter()  # server -> generations it answered (a batch counts each prompt)
        self._heard: set[str] = set()  # servers that answered since they (last) entered the pool
        self._has_servers = asyncio.Event()  # clear while the pool holds fewer than min_servers
        self._said_waiting = False  # the wait while the pool holds too few servers was logged (once per wait)
        self._has_servers.set()

    async def __aenter__(self) -> InferenceClient:
        await self._http.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.close()

    @property
    def in_flight(self) -> dict[str, int]:
        """Generate requests sent and not yet answered, per server (a copy, for metrics)."""
        return dict(self._http.in_flight)

    def pick(self, avoid: Sequence[str] = ()) -> str:
        """The server the next generate request goes to; ``avoid`` (failed ones) unless all are avoided."""
        n = len(self.addresses)
        order = [self.addresses[(self._cursor + i) % n] for i in range(n)]
        candidates = [server for server in order if server not in avoid] or order
        if self.policy == "round_robin":
            choice = candidates[0]
        else:  # min() keeps the first of equals, so ties go round-robin from the cursor
            choice = min(candidates, key=self._http.in_flight.__getitem__)
        self._cursor = (self.addresses.index(choice) + 1) % n
        return choice

    def remove(self, server: str, *, last_ok: bool = False) -> None:
        """Take a dead server out of the pool: no new request and no control call goes to it again.

        Requests already sent to it end now and go again on the other servers (a weight update sent to it fails). The
        last server goes only with ``last_ok`` (one that is restarting): requests then wait for ``add``."""
        if server not in self.addresses:
            raise ValueError(f"server {server!r} is not in the pool: {', '.join(self.addresses)}")
        if len(self.addresses) == 1 and not last_ok:
            raise ValueError(f"server {server!r} is the last one in the pool")
        self.addresses.remove(server)
        self._http.leave(server)  # its requests in flight go to the others now, not at their deadline
        self._heard.discard(server)
        self._cursor %= max(len(self.addresses), 1)
        if len(self.addresses) < self.min_servers and self._has_servers.is_set():
            self._has_servers.clear()
            self._said_waiting = False

    def add(self, server: str) -> None:
        """Put a server (back) into the pool, e.g. one restarted after it died: requests go to it from now."""
        if server in self.addresses:
            raise ValueError(f"server {server!r} is already in the pool")
        self._http.add(server)  # raises ValueError if it is not host:port
        self.addresses.append(server)
        if len(self.addresses) >= self.min_servers:
            self._has_servers.set()

    def set_servers(self, servers: Sequence[str]) -> None:
        """Make the pool exactly ``servers`` (in that order), e.g. as another process's pool changed; a bad
        address or a repeated one raises ValueError before the pool changes."""
        if len(set(servers)) != len(servers):
            raise ValueError(f"servers must not repeat a server, got {list(servers)}")
        for server in servers:
            self._http.add(server)  # raises ValueError if it is not host:port
        for server in [s for s in self.addresses if s not in servers]:
            self.remove(server, last_ok=True)
        for server in [s for s in servers if s not in self.addresses]:
            self.add(server)
        self.addresses.sort(key=list(servers).index)

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        server: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateResult:
        """Generate from one prompt on ``server``, or on a server picked by the policy (again on each retry), with
        the LoRA adapter loaded under the name ``lora_path`` (None: the client's ``adapter``; without one, the base
        model)."""
        check_sampling(sampling_params)
        if not input_ids:
            raise ValueError("input_ids is empty; a prompt needs at least one token")
        sampling_params = self._fitted(len(input_ids), sampling_params)
        payload: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if rid is not None:
            payload["rid"] = rid
        lora_path = self.adapter if lora_path is None else lora_path
        if lora_path is not None:
            payload["lora_path"] = check_adapter_name(lora_path)
        chosen, answer = await self._http.call(self._chooser(server), "POST", "/generate", payload, count=1)
        return self._counted([parse_result(chosen, answer, return_logprob)])[0]

    async def generate_many(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        *,
        return_logprob: bool = True,
        server: str | None = None,
        lora_path: str | Sequence[str | None] | None = None,
    ) -> list[GenerateResult]:
        """Generate from several prompts in one batched request to one server; results in prompt order.
        ``sampling_params`` is one dict for every prompt, or one per prompt (SGLang takes either); ``lora_path``
        one adapter name for every prompt, or one per prompt (None: the client's ``adapter``, or the base model)."""
        if not input_ids:
            raise ValueError("input_ids is an empty batch; it needs at least one prompt")
        empty = [i for i, ids in enumerate(input_ids) if not ids]
        if empty:
            raise ValueError(f"input_ids[{empty[0]}] is empty; a prompt needs at least one token")
        each = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        if len(each) != len(input_ids):
            raise ValueError(f"sampling_params has {len(each)} entries for {len(input_ids)} prompts")
        for one in {id(p): p for p in each}.values():
            check_sampling(one)
        fitted = [self._fitted(len(ids), p) for ids, p in zip(input_ids, each, strict=True)]
        params: Any = sampling_params if all(f is p for f, p in zip(fitted, each, strict=True)) else fitted
        payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": return_logprob}
        adapters = _batch_adapters(self.adapter if lora_path is None else lora_path, len(input_ids))
        if adapters is not None:
            payload["lora_path"] = adapters
        chosen, answer = await self._http.call(
            self._chooser(server), "POST", "/generate", payload, count=len(input_ids)
        )
        if not isinstance(answer, list) or len(answer) != len(input_ids):
            raise InferenceError(
                f"POST /generate on {chosen} answered a batch of {len(input_ids)} prompts with "
                f"{len(answer) if isinstance(answer, list) else type(answer).__name__} results",
                server=chosen,
                endpoint="/generate",
            )
        return self._counted([parse_result(chosen, item, return_logprob) for item in answer])

    def _counted(self, results: list[GenerateResult]) -> list[GenerateResult]:
        """Count the answers of each server (``answered``); a server's first answer since it entered the pool is
        logged with its weight version, which says that a server that (re)joined serves the weights the others do."""
        server = results[0].server
        if server not in self._heard:
            self._heard.add(server)
            logger.info("first answer from server %s: weight version %s", server, results[0].weight_version)
        self.answered[server] += len(results)
        return results

    async def wait_healthy(
        self, timeout_s: float, check_alive: Callable[[], None] | None = None, poll_s: float = 1.0
    ) -> None:
        """Poll GET /health on every server until each has answered 200 once.

        ``check_alive()`` runs before every poll and should raise if a server's process or job has died;
        its exception propagates at once. At the deadline, InferenceError names the servers not healthy.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = dict.fromkeys(self.addresses, "not polled")  # server -> why it is not healthy yet
        while True:
            if check_alive is not None:
                check_alive()
            probe_s = min(max(deadline - loop.time(), 0.1), HEALTH_PROBE_TIMEOUT_S)
            errors = await asyncio.gather(*(self._http.probe_health(s, probe_s) for s in pending))
            for server, error in zip(list(pending), errors, strict=True):
                if error:
                    pending[server] = error
                else:
                    del pending[server]
                    logger.info("inference server %s is healthy", server)
            if not pending:
                return
            if loop.time() >= deadline:
                raise InferenceError(
                    f"{len(pending)} of {len(self.addresses)} inference servers not healthy after {timeout_s:g} s: "
                    + ", ".join(f"{s} ({why})" for s, why in pending.items())
                    + ". Check their logs; if they are still loading the model, raise the health timeout",
                    server=next(iter(pending)),
                )
            await asyncio.sleep(min(poll_s, max(deadline - loop.time(), 0.0)))

    async def pause(self, mode: str = "abort") -> None:
        """Stop generation on every server; ``abort`` ends running requests with finish_reason "abort"."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self._http.call_all("POST", "/pause_generation", self._same({"mode": mode}))

    async def resume(self) -> None:
        await self._http.call_all("POST", "/continue_generation", self._same({}))

    async def flush_cache(self) -> None:
        """Drop every server's prefix cache (SGLang refuses with HTTP 400 while requests are running)."""
        await self._http.call_all("POST", "/flush_cache", self._same(None), expect_json=False)

    async def model_info(self) -> dict[str, dict[str, Any]]:
        """GET /model_info of every server, by address."""
        return await self._http.call_all("GET", "/model_info", self._same(None))

    async def abort(self, rid: str | None = None) -> None:
        """Abort, on every server, the request sent with exactly this ``rid``, or every request (None).

        SGLang matches no prefix: a rid no request in flight holds aborts nothing (a server that knows the
        rid also ends those whose rids start with it). A batch's prompts run as ``rid_0``, ``rid_1``, ...;
        abort each by its own rid."""
        if rid == "":
            raise ValueError("rid must be a request's rid, or None to abort every request")
        payload: dict[str, Any] = {"abort_all": True} if rid is None else {"rid": rid}
        await self._http.call_all("POST", "/abort_request", self._same(payload), expect_json=False)

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | int,
        *,
        timeout_s: float | None = None,
        servers: Sequence[str] | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every server (or those in ``servers``) loads the checkpoint at ``model_path``, a path its node can read.

        SGLang answers after the load and the cache flush: the deadline is ``weight_update_timeout_s``. With
        ``abort_all_requests`` the running requests end first (``finish_reason`` abort, with what they have);
        unpaused, SGLang holds new requests until the load is done (its model-update lock)."""
        payload = {"model_path": model_path, "weight_version": str(weight_version), "flush_cache": True}
        if abort_all_requests:
            payload["abort_all_requests"] = True
        payloads = self._same(payload) if servers is None else self._only(servers, payload)
        await self._http.call_all(
            "POST",
            "/update_weights_from_disk",
            payloads,
            timeout_s=self._weights_deadline(timeout_s),
            check=check_success,
        )

    async def update_weight_version(
        self, weight_version: str | int, *, timeout_s: float | None = None, servers: Sequence[str] | None = None
    ) -> None:
        """Every server (or those in ``servers``) reports ``weight_version`` from now on, as the version of what it
        generates (a LoRA adapter's load does not change it). SGLang would abort every running request first
        unless told not to: here they are not (the caller pauses generation around an update)."""
        payload = {"new_version": str(weight_version), "abort_all_requests": False}
        payloads = self._same(payload) if servers is None else self._only(servers, payload)
        deadline = self._weights_deadline(timeout_s)
        await self._http.call_all("POST", "/update_weight_version", payloads, timeout_s=deadline, check=check_success)

    def weights_group_world_size(self) -> int:
        """World size of the weight-update group: the trainer's rank 0 plus every tensor-parallel rank."""
        return group_layout([self.tp_size] * len(self.addresses))[0]

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "gloo",
        *,
        timeout_s: float | None = None,
    ) -> int:
        """Make every server join the trainer's process group at ``master_address:master_port`` (trainer rank 0's
        node and a port it listens on); returns the group's world size.

        Server i's tensor-parallel rank t is rank ``rank_offset_i + t`` (``weight_group.group_layout``); the
        trainer is rank 0 and must join concurrently, or every server waits for it.
        """
        world_size, offsets = group_layout([self.tp_size] * len(self.addresses))
        payloads = {
            server: {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            for server, offset in zip(self.addresses, offsets, strict=True)
        }
        await self._collective("/init_weights_update_group", payloads, timeout_s)
        return world_size

    async def begin_weight_update(self, *, timeout_s: float | None = None) -> None:
        """Open the weight-update session on every server (SGLang refuses a distributed update outside one)."""
        await self._collective("/begin_weight_update", self._same({}), timeout_s)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        weight_version: str | int,
        group_name: str = DEFAULT_GROUP,
        *,
        flush_cache: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        """Every server receives these tensors (one bucket) by broadcast from the trainer, which sends them
        concurrently; inside ``begin_weight_update`` .. ``end_weight_update``. Each server allocates a buffer
        for every tensor of the call first: keep the call's bytes bounded. ``flush_cache``: on the last
        bucket of a push (a flush per bucket costs without need)."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor, got {len(names)}, {len(dtypes)} "
                f"and {len(shapes)}"
            )
        payload = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(shape) for shape in shapes],
            "group_name": group_name,
            "weight_version": str(weight_version),
            "flush_cache": flush_cache,
        }
        await self._collective("/update_weights_from_distributed", self._same(payload), timeout_s)

    async def end_weight_update(self, *, timeout_s: float | None = None) -> None:
        """Close the weight-update session on every server."""
        await self._collective("/end_weight_update", self._same({}), timeout_s)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        await self._collective("/destroy_weights_update_group", self._same({"group_name": group_name}), None)

    async def load_lora_adapter(
        self, name: str, path: str, *, timeout_s: float | None = None, servers: Sequence[str] | None = None
    ) -> None:
        """Every server (or those in ``servers``: a restarted one) loads the PEFT adapter in directory ``path`` (one
        its node can read: adapter_config.json, adapter_model.safetensors) under ``name``, which generate requests
        then give as ``lora_path``.

        SGLang refuses a name it holds already (unload it first), an adapter of a rank above its
        ``--max-lora-rank`` or with modules outside its ``--lora-target-modules``, and any LoRA call to a server
        without ``--enable-lora``: InferenceError naming the server and SGLang's reason. Not retried (a second
        load of the name would be refused); the deadline is ``weight_update_timeout_s``."""
        payload = {"lora_name": check_adapter_name(name), "lora_path": str(path)}
        await self._lora("/load_lora_adapter", payload, timeout_s, servers)

    async def load_lora_adapter_from_tensors(
        self,
        name: str,
        config_dict: dict[str, Any],
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        timeout_s: float | None = None,
        servers: Sequence[str] | None = None,
    ) -> None:
        """As ``load_lora_adapter``, from the adapter's ``adapter_config.json`` as a dict and its full tensors
        ({name: tensor} or pairs, named as PEFT saves them), sent in the body: one copy per tensor-parallel rank
        of each server (``tp_size``), serialized as SGLang decodes them (``client_lora.serialized_tensors``, in a
        thread, off the event loop)."""
        check_adapter_name(name)
        payload = {
            "lora_name": name,
            "config_dict": checked_config(config_dict),
            "serialized_named_tensors": await asyncio.to_thread(serialized_tensors, named_tensors, self.tp_size),
        }
        await self._lora("/load_lora_adapter_from_tensors", payload, timeout_s, servers)

    async def unload_lora_adapter(
        self, name: str, *, timeout_s: float | None = None, servers: Sequence[str] | None = None
    ) -> None:
        """Every server (or those in ``servers``) unloads the adapter ``name``: SGLang stops new requests from naming
        it at once, and answers once the requests that name it have ended (pause with ``abort`` to end them
        sooner), within ``weight_update_timeout_s``. A name it does not hold is refused (InferenceError)."""
        await self._lora("/unload_lora_adapter", {"lora_name": check_adapter_name(name)}, timeout_s, servers)

    async def _lora(
        self, endpoint: str, payload: dict[str, Any], timeout_s: float | None, servers: Sequence[str] | None
    ) -> None:
        payloads = self._same(payload) if servers is None else self._only(servers, payload)
        deadline = self._weights_deadline(timeout_s)
        await self._http.call_all("POST", endpoint, payloads, retries=0, timeout_s=deadline, check=check_lora_update)

    async def _collective(self, endpoint: str, payloads: dict[str, Any], timeout_s: float | None) -> None:
        deadline = self._weights_deadline(timeout_s)
        await self._http.call_all("POST", endpoint, payloads, retries=0, timeout_s=deadline, check=check_success)

    def _weights_deadline(self, timeout_s: float | None) -> float:
        return self.weight_update_timeout_s if timeout_s is None else timeout_s

    def _fitted(self, prompt_tokens: int, sampling_params: dict[str, Any]) -> dict[str, Any]:
        """``sampling_params`` if SGLang serves the request (``context.fit``: its margins included); else, when
        SGLang takes the prompt, as many new tokens as it accepts (truncate); else ContextLengthError."""
        new_tokens = sampling_params["max_new_tokens"]
        context = self.context_length
        if context is None or not fit(prompt_tokens, new_tokens, context):
            return sampling_params
        if self.context_overflow == "truncate" and prompt_tokens < max_input_len(context):
            return {**sampling_params, "max_new_tokens": context - prompt_tokens}
        raise ContextLengthError(prompt_tokens, new_tokens, context)

    def _same(self, payload: Any) -> dict[str, Any]:
        return dict.fromkeys(self.addresses, payload)

    def _only(self, servers: Sequence[str], payload: Any) -> dict[str, Any]:
        for server in servers:
            self._http.add(server)  # raises ValueError if it is not host:port
        return dict.fromkeys(servers, payload)

    def _chooser(self, server: str | None) -> Callable[[list[str]], Awaitable[str]]:
        if server is None:
            return self._pick_when_any
        if server not in self._http.in_flight:
            raise ValueError(f"server {server!r} is not one of this client's servers: {', '.join(self.addresses)}")
        return fixed(server)

    async def _pick_when_any(self, tried: list[str]) -> str:
        """``pick``, once the pool has ``min_servers``: while it has fewer, wait for servers to join (a deadline)."""
        if len(self.addresses) < self.min_servers:
            live, least, wait_s = len(self.addresses), self.min_servers, self.no_server_timeout_s
            if not self._said_waiting:  # once, not for each of the requests that wait
                self._said_waiting = True
                logger.info("%d of at least %d servers in the pool; waiting up to %g s for more", live, least, wait_s)
            try:
                await asyncio.wait_for(self._has_servers.wait(), wait_s)
            except TimeoutError:
                raise InferenceError(
                    f"the pool held {len(self.addresses)} inference servers, fewer than {least}, for {wait_s:g} s; "
                    "the servers died and not enough came back or joined (see their logs)",
                    server=", ".join(tried) or "none",
                    endpoint="/generate",
                ) from None
        return self.pick(tried)


def _batch_adapters(lora_path: str | Sequence[str | None] | None, prompts: int) -> str | list[str | None] | None:
    """``generate_many``'s ``lora_path`` as the body gives it: one name, one per prompt, or None (all on the base
    model). SGLang 0.5.23 does not check a list's length against the batch, so it is checked here."""
    if lora_path is None or isinstance(lora_path, str):
        return None if lora_path is None else check_adapter_name(lora_path)
    names = list(lora_path)
    if len(names) != prompts:
        raise ValueError(f"lora_path has {len(names)} entries for {prompts} prompts")
    if all(name is None for name in names):
        return None
    return [None if name is None else check_adapter_name(name) for name in names]


def _check_weight_args(tp_size: int, timeout_s: float, context_length: int | None, overflow: str) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1 (a server's tensor-parallel ranks), got {tp_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"weight_update_timeout_s must be > 0, got {timeout_s}")
    if context_length is not None and context_length < 2:
        raise ValueError(f"context_length must be None or >= 2 tokens, got {context_length}")
    if overflow not in OVERFLOW:
        raise ValueError(f"context_overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")


def _check_args(
    addresses: Sequence[str], timeout_s: float, max_retries: int, backoff_s: float, policy: str, max_connections: int
) -> None:
    if isinstance(addresses, str) or not addresses:
        raise ValueError(f"addresses must be a non-empty list of host:port strings, got {addresses!r}")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"addresses must not repeat a server, got {list(addresses)}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {timeout_s}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    if backoff_s < 0:
        raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
