"""The CPU server's LoRA adapters, with SGLang 0.5.23's routes, registry, refusals and messages.

    /load_lora_adapter               a PEFT directory on disk (``LoadLoRAAdapterReqInput``)
    /load_lora_adapter_from_tensors  ``config_dict`` (adapter_config.json) + ``serialized_named_tensors``
    /unload_lora_adapter             by name; waits until no request in flight uses it, as SGLang does

Every answer is SGLang's ``LoRAUpdateOutput`` (``success``, ``error_message``, ``loaded_adapters``: name ->
path, ``"__tensor__"`` for tensors), 200 or 400. What SGLang refuses is refused here with its message
(``srt/managers/tokenizer_control_mixin.py``, ``srt/lora/lora_manager.py``, ``srt/lora/lora_registry.py``):
LoRA routes without ``--enable-lora``; a name already loaded; an adapter whose rank is over
``--max-lora-rank`` or whose target modules (normalized: q/k/v -> qkv_proj, gate/up -> gate_up_proj) are
not within ``--lora-target-modules``; DoRA, or tokens added to the vocabulary; a pinned adapter that would
pin every slot of ``--max-loras-per-batch``; unloading a name not loaded.

A ``/generate`` names its adapter with ``lora_path`` (``resolve``, after any pause of generation has ended,
as SGLang's requests wait for it before they look their adapters up): an adapter never loaded is a 400 with
SGLang's message; one that was loaded and then unloaded is loaded again from its path first, as SGLang's
tokenizer manager does (an adapter loaded from tensors has no path: that load fails, and the request with
it). A request holds its adapters until each of its sequences has finished; an unload takes the name out
of the registry at once (later requests reload it, and wait for the unload to end) and removes the
adapter from the model once no sequence uses it. Loads and unloads run on the torch thread between two
decode steps, so a running batch never sees an adapter change under it.

hpcrl's CPU server is stricter than SGLang where SGLang would compute something else than PEFT without a
word: an adapter with ``use_rslora``, ``rank_pattern``/``alpha_pattern``, a bias or ``modules_to_save`` is
refused (SGLang scales every module by ``lora_alpha / r`` and loads only lora_A/lora_B), and so is an adapter
whose tensors do not cover exactly the modules it targets (SGLang leaves those at zero, or ignores extras).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from hpcrl.inference.server import lora_model, requests
from hpcrl.inference.server.requests import Field, read_body
from hpcrl.inference.server.runner import ModelRunner
from hpcrl.inference.server.sampling import RequestError
from hpcrl.inference.server.scheduler import Scheduler, Sequence
from hpcrl.inference.server.tensor_payload import PayloadError, decode_named_tensors

log = logging.getLogger(__name__)

# SGLang's SUPPORTED_LORA_TARGET_MODULES (srt/utils/common.py) and its "all"
TARGET_MODULES = [
    *("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b"),
    *("wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens"),
    *("lm_head", "qkvr", "wo_ud"),
]
ALL = "all"
TENSOR_PATH = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# SGLang's get_normalized_target_modules: the fused modules its LoRA buffers are kept for
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
_FUSED |= {"up_proj": "gate_up_proj", "embeddings": "embed_tokens", "vocab_emb": "embed_tokens"}
_FUSED |= {"word_embeddings": "embed_tokens", "output": "lm_head", "unembed_tokens": "lm_head"}
_FUSED |= {"q_a_proj": "fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa"}
_FUSED |= {"wq_b": "indexer.wq_b", "wk": "indexer.wk", "weights_proj": "indexer.weights_proj"}

_OPT_DICT = Field(lambda v: v is None or isinstance(v, dict), "an object or null")
LOAD = {**requests.BASE, "lora_name": requests.STR, "lora_path": requests.STR, "pinned": requests.BOOL}
LOAD |= {"lora_id": requests.OPT_STR}
LOAD_TENSORS = {**requests.BASE, "lora_name": requests.STR, "pinned": requests.BOOL, "lora_id": requests.OPT_STR}
LOAD_TENSORS |= {
    "config_dict": Field(lambda v: isinstance(v, dict), "an object (the adapter's adapter_config.json)"),
    "serialized_named_tensors": Field(
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of base64 strings"
    ),
    "added_tokens_config": _OPT_DICT,
    "load_format": Field(requests.OPT_STR.check, requests.OPT_STR.expected, only=None),
    "expected_checksums": Field(_OPT_DICT.check, _OPT_DICT.expected, only=None),
}
UNLOAD = {**requests.BASE, "lora_name": requests.STR, "lora_id": requests.OPT_STR}


def normalized_targets(names: Any) -> set[str]:
    """SGLang's ``get_normalized_target_modules``: each name's last part, fused q/k/v and gate/up; PEFT's
    ``"all-linear"`` / ``"all"`` as {"all"}."""
    if isinstance(names, str):
        if names not in (ALL, "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {ALL}
    return {_FUSED.get(name.split(".")[-1], name.split(".")[-1]) for name in names}


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA launch flags, resolved as SGLang's ``check_lora_server_args`` and ``init_lora_shapes`` do."""

    enabled: bool = False
    max_rank: int = 0
    targets: frozenset[str] = frozenset()  # normalized; {"all"}: every supported module
    max_per_batch: int = 8
    initial: tuple[tuple[str, str, bool], ...] = ()  # (name, path, pinned) of --lora-paths


def lora_settings(
    enable: bool, max_rank: int | None, targets: list[str] | None, paths: list[str] | None, max_per_batch: int
) -> LoraSettings:
    """The launch flags as SGLang resolves them (``check_lora_server_args``, ``init_lora_shapes``); a ValueError
    with SGLang's message where it refuses them. ``--lora-paths`` turns LoRA on; without it, ``--max-lora-rank``
    and ``--lora-target-modules`` are required; given, they are inferred from its adapters when left out."""
    if max_per_batch <= 0:
        raise ValueError("max_loras_per_batch must be positive")
    enabled = enable or bool(paths)
    if not enabled:
        if max_rank is not None or targets:
            raise ValueError(
                "--max-lora-rank and --lora-target-modules need --enable-lora (SGLang would ignore them silently)"
            )
        return LoraSettings(max_per_batch=max_per_batch)
    if targets and ALL in targets and len(targets) != 1:
        raise ValueError("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
    initial = tuple(parse_lora_path(p) for p in paths or [])
    if not initial and not (max_rank and targets):
        raise ValueError(
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
            "--lora-target-modules for LoRA initialization."
        )
    resolved = {ALL} if targets and ALL in targets else normalized_targets(targets or [])
    ranks = []
    for name, path, _ in initial:
        config, _ = _config_from_disk(path)
        ranks.append(config["r"])
        adapter_targets = normalized_targets(config["target_modules"])
        if not targets:
            resolved |= adapter_targets
        elif ALL not in resolved and ALL not in adapter_targets and not adapter_targets <= resolved:
            raise ValueError(
                f"LoRA adapter '{name}' contains target modules {sorted(adapter_targets - resolved)} that are not "
                f"included in the specified --lora-target-modules {sorted(resolved)}. Please update "
                f"--lora-target-modules to include all required modules: {sorted(resolved | adapter_targets)}, or use "
                "'all' to enable all supported modules."
            )
    rank = max_rank if max_rank is not None else max(ranks, default=0)
    return LoraSettings(True, rank, frozenset(resolved), max_per_batch, initial)


def parse_lora_path(spec: str) -> tuple[str, str, bool]:
    """One ``--lora-paths`` entry in SGLang's forms: ``PATH`` (named by its path), ``NAME=PATH``, or JSON
    ``{"lora_name": ..., "lora_path": ..., "pinned": ...}``."""
    spec = spec.strip()
    if spec.startswith("{") and spec.endswith("}"):
        obj = json.loads(spec)
        if "lora_path" not in obj or "lora_name" not in obj:
            raise ValueError(
                f"{spec!r} looks like a JSON str, but it does not contain 'lora_name' and 'lora_path' keys."
            )
        return str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False))
    name, eq, path = spec.partition("=")
    return (name, path, False) if eq else (spec, spec, False)


@dataclass(frozen=True)
class Ref:
    """SGLang's ``LoRARef``: one load of an adapter, under an id no other load has."""

    name: str
    path: str
    pinned: bool
    id: str = ""

    @staticmethod
    def new(name: str, path: str, pinned: bool) -> Ref:
        return Ref(name, path, pinned, uuid.uuid4().hex)


class Adapters:
    """The registry of one server (SGLang's tokenizer-side ``LoRARegistry``) and the adapters in its model."""

    def __init__(self, settings: LoraSettings, runner: ModelRunner, scheduler: Scheduler):
        self.settings, self.runner, self.scheduler = settings, runner, scheduler
        self.registry: OrderedDict[str, Ref] = OrderedDict()  # name -> Ref, what requests may name
        self.ref_cache: dict[str, Ref] = {}  # every name ever loaded, for the reload of an unloaded one
        self.loaded: dict[str, Ref] = {}  # id -> Ref, what the model holds (SGLang's backend lora_refs)
        self.in_use: dict[str, int] = {}  # id -> sequences in flight
        self.pending_unloads: dict[str, str] = {}  # name -> id being unloaded
        self._freed = asyncio.Condition()  # a sequence released its adapter
        self._notifying: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()  # SGLang's lora_update_lock: one load or unload at a time
        scheduler.max_loras_per_batch = settings.max_per_batch

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/load_lora_adapter", self.load_route),
            web.post("/load_lora_adapter_from_tensors", self.load_tensors_route),
            web.post("/unload_lora_adapter", self.unload_route),
        ]

    def load_initial(self) -> None:
        """Load ``--lora-paths`` at start (no event loop yet); a ValueError with the adapter's message."""
        for name, path, pinned in self.settings.initial:
            ref = Ref(name, path, pinned, uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex)
            ok, error = self._backend_load(ref, lambda p=path: _config_from_disk(p), lambda p=path: _tensors(p))
            if not ok:
                raise ValueError(f"--lora-paths {name}={path}: {error}")
            self.registry[name], self.ref_cache[name], self.in_use[ref.id] = ref, ref, 0

    # ------------------------------------------------------------------------------------------- routes
    async def load_route(self, request: web.Request) -> web.Response:
        body = await read_body(request, LOAD)
        name, path = _required(body, "lora_name"), _required(body, "lora_path")
        return _answer(await self.load(name, path, body.get("pinned", False)))

    async def load_tensors_route(self, request: web.Request) -> web.Response:
        body = await read_body(request, LOAD_TENSORS)
        name, config = _required(body, "lora_name"), _required(body, "config_dict")
        payloads = _required(body, "serialized_named_tensors")
        added = body.get("added_tokens_config")
        if not self.settings.enabled:
            return _answer(_output(False, NOT_ENABLED, None))
        if not payloads:
            raise RequestError("serialized_named_tensors must hold one payload per tensor-parallel rank, got none")
        ref = Ref.new(name, TENSOR_PATH, body.get("pinned", False))
        return _answer(await self._load(ref, lambda: (config, added), lambda: decode_named_tensors(payloads[0])))

    async def unload_route(self, request: web.Request) -> web.Response:
        body = await read_body(request, UNLOAD)
        return _answer(await self.unload(_required(body, "lora_name")))

    # ------------------------------------------------------------------------------------- the registry
    async def load(self, name: str, path: str, pinned: bool) -> dict[str, Any]:
        if not self.settings.enabled:
            return _output(False, NOT_ENABLED, None)
        return await self._load(Ref.new(name, path, pinned), lambda: _config_from_disk(path), lambda: _tensors(path))

    async def _load(self, ref: Ref, config, tensors) -> dict[str, Any]:
        async with self._lock:
            if ref.name in self.pending_unloads:
                return _output(
                    False,
                    f"LoRA adapter '{ref.name}' has an incomplete unload. Retry the unload before loading it again.",
                    None,
                )
            ok, error = await self.scheduler.call_torch(lambda: self._backend_load(ref, config, tensors))
            if ok:
                self.registry[ref.name], self.ref_cache[ref.name], self.in_use[ref.id] = ref, ref, 0
                log.info("loaded LoRA adapter %s from %s", ref.name, ref.path)
            return _output(ok, error, self._loaded_adapters())

    async def unload(self, name: str) -> dict[str, Any]:
        if not self.settings.enabled:
            return _output(False, NOT_ENABLED, None)
        async with self._lock:
            adapter_id = self.pending_unloads.get(name)
            if adapter_id is None:
                ref = self.registry.pop(name, None)
                if ref is None:
                    return _output(
                        False, f"LoRA with name {name} does not exist. Loaded LoRAs: {self.registry.keys()}", None
                    )
                adapter_id = self.pending_unloads[name] = ref.id
            async with self._freed:  # SGLang's wait_for_unload: the requests using it end first
                await self._freed.wait_for(lambda: not self.in_use.get(adapter_id))
            self.in_use.pop(adapter_id, None)
            await self.scheduler.call_torch(lambda: lora_model.remove_adapter(self.runner, adapter_id))
            self.loaded.pop(adapter_id, None)
            self.pending_unloads.pop(name)
            log.info("unloaded LoRA adapter %s", name)
            return _output(True, "", self._loaded_adapters())

    # ------------------------------------------------------------------------------------- requests
    async def resolve(self, lora_path: Any, names: list[str | None]) -> list[str | None]:
        """The adapter ids of a request's sequences (``names``: each one's ``lora_path``), each counted as in
        use until ``release``; SGLang's ``_validate_and_resolve_lora`` and ``LoRARegistry.acquire``."""
        if not lora_path:
            return [None] * len(names)
        # SGLang's request waits out a pause before it looks its adapters up: a push that unloads and loads an
        # adapter while generation is paused is what the requests arriving meanwhile find
        await self.scheduler.wait_resumed()
        if not self.settings.enabled:
            first = lora_path if isinstance(lora_path, str) else next((a for a in lora_path if a), None)
            raise RequestError(
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        for name in dict.fromkeys(n for n in names if n is not None and n not in self.registry):
            if name not in self.ref_cache:
                raise RequestError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {self.ref_cache.keys()}."
                )
            log.info("Reloading evicted adapter: %s", name)
            ref = self.ref_cache[name]
            result = await self.load(ref.name, ref.path, ref.pinned)
            if not result["success"] and "already loaded" not in result["error_message"]:
                raise RequestError(f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}")
        ids: list[str | None] = []
        for wanted in names:
            if wanted is not None and wanted not in self.registry:  # unloaded again while this request reloaded it
                raise RequestError(
                    f"The following requested LoRA adapters are not loaded: {wanted}\n"
                    f"Loaded adapters: {self.registry.keys()}."
                )
            ids.append(None if wanted is None else self.registry[wanted].id)
        for adapter_id in ids:
            if adapter_id is not None:
                self.in_use[adapter_id] += 1
        return ids

    def hold(self, seq: Sequence) -> None:
        """Release ``seq``'s adapter once it has finished (or failed), as SGLang releases each sub-request's."""
        if seq.lora is not None:
            seq.done.add_done_callback(lambda _: self.release([seq.lora]))

    def release(self, ids: list[str | None]) -> None:
        for adapter_id in ids:
            if adapter_id is not None and adapter_id in self.in_use:
                self.in_use[adapter_id] -= 1
        task = asyncio.get_running_loop().create_task(self._notify())
        self._notifying.add(task)  # a task nobody holds may be collected before it runs
        task.add_done_callback(self._notifying.discard)

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    # ------------------------------------------------------------------------------------- the model
    def _backend_load(self, ref: Ref, config, tensors) -> tuple[bool, str]:
        """On the torch thread: check the adapter against the server's LoRA settings, then put it into the
        model (SGLang's ``LoRAManager.load_lora_adapter``); (success, error message)."""
        try:
            config_dict, added = config()
            if not isinstance(config_dict, dict):
                raise ValueError(f"the adapter config must be a JSON object, got {type(config_dict).__name__}")
            self._validate(config_dict, added, ref)
            lora_model.add_adapter(self.runner, ref.id, lora_model.peft_config(config_dict), tensors())
        except (OSError, KeyError, ValueError, TypeError, PayloadError) as e:
            return False, str(e)
        self.loaded[ref.id] = ref
        return True, ""

    def _validate(self, config: dict[str, Any], added: dict | None, ref: Ref) -> None:
        """SGLang's ``validate_new_adapter``, in its order, then what this server refuses beyond it."""
        added = {t: i for t, i in (added or {}).items() if isinstance(i, int) and i >= self.runner.vocab_size}
        if added:
            raise ValueError(
                f"Failed to load {ref.name} because LoRA serving currently doesn't support adapters that add tokens "
                "to the vocabulary"
            )
        if config.get("use_dora", False):
            raise ValueError(f"Failed to load {ref.name} because LoRA serving currently doesn't support DoRA adapters")
        for existing in self.loaded.values():
            if existing.name == ref.name:
                raise ValueError(f"Failed to load LoRA adapter {ref.name} because it is already loaded")
        rank, targets = config["r"], normalized_targets(config["target_modules"])
        if rank > self.settings.max_rank or not (
            ALL in targets or ALL in self.settings.targets or targets <= self.settings.targets
        ):
            raise ValueError(
                f"LoRA adapter {ref.name} with rank {rank} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` "
                "and that the target modules are included in `--lora-target-modules`."
            )
        pinned = sum(r.pinned for r in self.loaded.values())
        if ref.pinned and pinned >= self.settings.max_per_batch - 1:
            raise ValueError(
                f"Failed to load LoRA adapter {ref.name} as a pinned adapter. It is not allowed to pin all slots "
                "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase "
                "your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
            )
        _refuse_what_sglang_would_compute_otherwise(config, ref.name)

    def _loaded_adapters(self) -> dict[str, str]:
        return {ref.name: ref.path for ref in self.loaded.values()}


def _refuse_what_sglang_would_compute_otherwise(config: dict[str, Any], name: str) -> None:
    odd = {
        "use_rslora": config.get("use_rslora", False),
        "rank_pattern": config.get("rank_pattern") or {},
        "alpha_pattern": config.get("alpha_pattern") or {},
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": config.get("modules_to_save") or None,
    }
    set_ = sorted(k for k, v in odd.items() if v)
    if set_:
        raise ValueError(
            f"Failed to load LoRA adapter {name}: {set_} set in its config; SGLang serves every module with "
            "lora_alpha / r and only lora_A/lora_B, and so does hpcrl's CPU server: retrain without them"
        )


def _config_from_disk(path: str) -> tuple[dict[str, Any], dict | None]:
    """``adapter_config.json`` (and ``added_tokens.json``) of a PEFT directory; SGLang would look for a path that
    is no directory on the Hugging Face hub, which hpcrl's CPU server never does."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{path} is not a directory (hpcrl's CPU server loads adapters from local PEFT directories)")
    with open(folder / "adapter_config.json") as f:
        config = json.load(f)
    added_file = folder / "added_tokens.json"
    added = json.loads(added_file.read_text()) if added_file.is_file() else None
    return config, added


def _tensors(path: str):
    return lora_model.read_adapter_tensors(path)


def _required(body: dict[str, Any], name: str) -> Any:
    if name not in body:
        raise RequestError(f"field {name!r} is required")
    return body[name]


def _output(success: bool, error: str | None, adapters: dict[str, str] | None) -> dict[str, Any]:
    """SGLang's ``LoRAUpdateOutput`` as its route writes it (``msgspec_to_builtins``: every field)."""
    return {
        "rid": None,
        "http_worker_ipc": None,
        "success": success,
        "error_message": error,
        "loaded_adapters": adapters,
    }


def _answer(output: dict[str, Any]) -> web.Response:
    if not output["success"]:
        log.warning("%s", output["error_message"])
    return web.json_response(output, status=200 if output["success"] else 400)
