"""Reward models (a sequence-classification head) on the CPU server, served as SGLang 0.5.23 serves them.

What SGLang does, read from its wheel (paths inside the ``sglang`` package):

- **Recognised by architecture.** ``srt/configs/model_config.py::is_generation_model``: a model whose
  ``config.json`` ``architectures`` names ``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``,
  ``Qwen3ForSequenceClassification``, ``Gemma2ForSequenceClassification`` (or a reward/embedding class) is not a
  generation model, with or without ``--is-embedding``; ``--is-embedding`` (``srt/arg_groups/fields/model.py``,
  "use a CausalLM as an embedding model") turns any other model into one. ``/model_info`` then says
  ``"is_generation": false``. These classes score the hidden state of each sequence's **last** token
  (``srt/models/llama_reward.py``, ``qwen2_classification.py``: ``Pooler(pooling_type=PoolingType.LAST)``,
  then the ``score`` head): one float per label.
- **Route.** ``POST /classify`` (``srt/entrypoints/http_server.py::classify_request``, "a reward model
  request": the same as ``/encode``) takes ``EmbeddingReqInput`` (``srt/managers/io_struct.py``): exactly one
  of ``text`` (a string or a list of them) and ``input_ids`` (list[int], or list[list[int]] for a batch) is
  required ("At least one of text, input_ids, image, video, or audio should be provided", "text and input_ids
  cannot be provided at the same time"); ``rid`` a string for one prompt, a list of distinct strings for a
  batch (``normalize_batch_and_arguments``); ``sampling_params`` is a dummy (``max_new_tokens`` forced to 0).
  Text is tokenized with the tokenizer's defaults (``tokenizer(texts)``, special tokens included).
- **Answer** (``srt/managers/tokenizer_manager.py::_handle_batch_output``, ``BatchEmbeddingOutput``):
  ``{"embedding": [score, ...], "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version",
  "num_retractions", "e2e_latency"}}``, a list of these for a batch; ``finish_reason`` is
  ``{"type": "length", "length": 0}`` (one dummy output token against ``max_new_tokens`` 0,
  ``srt/managers/schedule_batch.py::update_finish_state``).
- **Refusals.** ``/classify`` on a generation model is a 400 ``{"error": {"message": "This model does not appear
  to be an embedding model by default. Please add `--is-embedding` ..."}}`` (``tokenizer_manager.py``,
  ``_validate_one_request``). SGLang has no check for ``/generate`` on a reward model: the request reaches its
  scheduler, which runs the classifier (``get_embedding``) instead of generating. This server refuses it with
  a 400 instead (``GENERATE_REFUSED``), so a client that relies on it fails here first.

This server serves a reward model with the routes a reward-model role needs: ``/classify`` (and ``/encode``,
the same), ``/health`` (one score of ``[0]``, as SGLang's health check sends an ``EmbeddingReqInput`` of
``input_ids=[0]``), ``/model_info``; ``/generate`` is refused. Its weights never change, so the weight-update,
LoRA, pause and cache routes are not served. Unknown fields and ``sampling_params`` are refused (SGLang would
ignore them). A prompt is held to the context as a request of ``max_new_tokens`` 0 (``context.fit``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from hpcrl.inference.context import fit
from hpcrl.inference.server.requests import MAX_BODY_BYTES, errors_as_json
from hpcrl.inference.server.runner import DTYPES
from hpcrl.inference.server.sampling import RequestError

log = logging.getLogger(__name__)

# SGLang 0.5.23's sequence-classification classes (is_generation_model) that score the last token
SEQUENCE_CLASSIFICATION = (
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
    "Gemma2ForSequenceClassification",
)
KNOWN_FIELDS = {"text", "input_ids", "rid"}
NOT_EMBEDDING = (
    "This model does not appear to be an embedding model by default. "
    "Please add `--is-embedding` when launching the server or try another model."
)
GENERATE_REFUSED = (
    "This model is a reward model (a sequence-classification head): it scores with /classify, it does not generate"
)
HEALTH_TIMEOUT_S = 20


def reward_model_kind(model_path: str | Path, is_embedding: bool) -> bool:
    """Whether ``model_path`` is served as a reward model, SGLang's way (the module docstring); ``ValueError`` for
    a model SGLang would serve otherwise than this server can: ``--is-embedding`` on a model with no
    sequence-classification head (SGLang would pool a causal LM's hidden states), or a classification class
    SGLang has no implementation of."""
    architectures = json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or []
    known = [a for a in architectures if a in SEQUENCE_CLASSIFICATION]
    other = [a for a in architectures if a.endswith("ForSequenceClassification") and a not in known]
    if other:
        raise ValueError(f"architectures {other}: SGLang 0.5.23 serves only {list(SEQUENCE_CLASSIFICATION)}")
    if is_embedding and not known:
        raise ValueError(
            f"--is-embedding with architectures {architectures}: hpcrl's CPU server serves --is-embedding only for a "
            f"sequence-classification model ({', '.join(SEQUENCE_CLASSIFICATION)})"
        )
    return bool(known)


class ClassifyRunner:
    """A ``transformers`` sequence-classification model: the scores of the last token of each prompt."""

    def __init__(self, model_path: str, dtype: str = "float32"):
        from transformers import AutoModelForSequenceClassification

        from hpcrl.models.tokenizer import load_tokenizer

        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=DTYPES[dtype]).eval()
        self.vocab_size = self.model.config.vocab_size
        log.info("loaded reward model %s (%s, %d labels)", model_path, dtype, self.model.config.num_labels)

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """One forward over the right-padded batch; each row's head reads its last real token, as SGLang's
        LAST pooling does. (transformers' own pooling looks for the last token that is not the pad id, which a
        prompt may contain.)"""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        hidden = self.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts])]
        return self.model.score(last).float().tolist()


def parse_classify(body: Any, tokenize, vocab_size: int, context: int) -> tuple[list[list[int]], list[str], bool]:
    """The prompts of a ``/classify`` body, their rids, and whether the answer is one object (not a list)."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise RequestError(
            f"unsupported field(s) {unknown}; hpcrl's CPU server's /classify takes {sorted(KNOWN_FIELDS)}"
        )
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise RequestError("At least one of text, input_ids, image, video, or audio should be provided")
    if text is not None and ids is not None:
        raise RequestError("text and input_ids cannot be provided at the same time")
    prompts, single = _text_prompts(text, tokenize) if text is not None else _id_prompts(ids)
    for i, prompt in enumerate(prompts):
        _check_prompt(prompt, "input_ids" if single else f"input_ids[{i}]", vocab_size, context)
    return prompts, _rids(body.get("rid"), len(prompts), single), single


def _text_prompts(text: Any, tokenize) -> tuple[list[Any], bool]:
    """``text``'s prompts, tokenized, and whether it is one prompt."""
    single = isinstance(text, str)
    texts = [text] if single else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError("text must be a string or a non-empty list of strings")
    return [tokenize(t) for t in texts], single


def _id_prompts(ids: Any) -> tuple[list[Any], bool]:
    """``input_ids``' prompts (checked by ``_check_prompt``) and whether it is one prompt."""
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids must be a non-empty list of token ids or a non-empty batch of them")
    single = not isinstance(ids[0], list)
    return ([ids] if single else ids), single


def _check_prompt(ids: Any, where: str, vocab_size: int, context: int) -> None:
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{where} must be a non-empty list of token ids")
    for j, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise RequestError(f"{where}[{j}]={t!r} is not a token id in 0..{vocab_size - 1}")
    problem = fit(len(ids), 0, context)
    if problem:
        raise RequestError(f"{where}: {problem}")


def _rids(rid: Any, batch_size: int, single: bool) -> list[str]:
    """SGLang's ``EmbeddingReqInput`` rids: one string for one prompt, a list of distinct strings for a batch."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(batch_size)]
    if single:
        if not isinstance(rid, str):
            raise RequestError(f"rid must be a string for a single prompt, got {rid!r}")
        return [rid]
    if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise RequestError("The rid should be a list.")
    if len(rid) != batch_size:
        raise RequestError(f"rid has {len(rid)} entries for a batch of {batch_size} prompts")
    duplicates = [r for r, count in Counter(rid).items() if count > 1]
    if duplicates:
        raise RequestError(f"Duplicate request IDs detected within the request: {duplicates}")
    return rid


class ClassifyServer:
    """The HTTP routes of a reward-model server (the module docstring); one forward at a time, off the loop."""

    def __init__(self, runner: ClassifyRunner, context_length: int, weight_version: str = "default"):
        self.runner, self.context_length, self.weight_version = runner, context_length, weight_version
        self._lock = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors_as_json])
        get, post = web.get, web.post
        app.add_routes(
            [
                get("/health", self.health),
                get("/health_generate", self.health),
                get("/model_info", self.model_info),
                get("/get_model_info", self.model_info),
                post("/classify", self.classify),
                post("/encode", self.classify),
                post("/generate", refuse_generate),
            ]
        )
        return app

    async def classify(self, request: web.Request) -> web.Response:
        start = time.perf_counter()
        body = await _json(request)
        prompts, rids, single = parse_classify(body, self._tokenize, self.runner.vocab_size, self.context_length)
        scores = await self._score(prompts)
        latency = time.perf_counter() - start
        out = [self._answer(s, rid, len(p), latency) for s, rid, p in zip(scores, rids, prompts, strict=True)]
        return web.json_response(out[0] if single else out)

    def _answer(self, scores: list[float], rid: str, prompt_tokens: int, latency: float) -> dict[str, Any]:
        meta = {"id": rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": prompt_tokens}
        meta |= {"weight_version": self.weight_version, "num_retractions": 0, "e2e_latency": latency}
        return {"embedding": scores, "meta_info": meta}

    async def _score(self, prompts: list[list[int]]) -> list[list[float]]:
        async with self._lock:  # torch's threads serve one batch at a time
            return await asyncio.to_thread(self.runner.score, prompts)

    async def health(self, _: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self._score([[0]]), HEALTH_TIMEOUT_S)
        except TimeoutError:
            log.error("health check failed: no score within %d s", HEALTH_TIMEOUT_S)
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, _: web.Request) -> web.Response:
        path = self.runner.model_path
        info = {"model_path": path, "tokenizer_path": path, "is_generation": False}
        info |= {"weight_version": self.weight_version, "preferred_sampling_params": None}
        return web.json_response({**info, "context_length": self.context_length})

    def _tokenize(self, text: str) -> list[int]:
        return self.runner.tokenizer(text)["input_ids"]


async def refuse_generate(_: web.Request) -> web.Response:
    return web.json_response({"error": {"message": GENERATE_REFUSED}}, status=400)


async def refuse_classify(_: web.Request) -> web.Response:
    """``/classify`` and ``/encode`` on a generation server: SGLang's 400."""
    return web.json_response({"error": {"message": NOT_EMBEDDING}}, status=400)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
