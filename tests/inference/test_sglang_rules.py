"""hpcrl's rules where SGLang 0.5.23 has one of its own, checked against SGLang's own code, loaded from its wheel.

``sglang_wheel.py`` runs single functions of SGLang's files with stand-ins for its runtime (a GPU is not
needed): what hpcrl's client and CPU server compute is compared with what these functions compute, over
every case that matters, not with numbers copied from them.

- Length: ``TokenizerManager._validate_one_request``, ``TpModelWorker.get_worker_info``'s
  ``max_req_input_len``, ``Scheduler.init_req_max_new_tokens`` (with the base KV allocator's
  ``max_new_tokens_for_memory``) and ``validate_input_length``, in the order SGLang runs them, against
  ``context.fit`` and ``context.served``.
- rids: ``GenerateReqInput``'s normalisation against ``protocol.sample_rids``.
- Stops: ``DetokenizerManager.trim_matched_stop`` against ``protocol.output_text``.
- Aborts: ``TokenizerManager.abort_request`` against ``Scheduler.abort``.
- ``/flush_cache``'s ``timeout`` and ``/health``'s timeout, as ``http_server.py`` declares them.

The same behaviour over HTTP, on a real CPU server, is in ``test_server_contract.py``.
"""

import ast
import asyncio
import functools
import logging
import re
from types import SimpleNamespace as NS

import pytest

from hpcrl.inference.context import fit, max_input_len, served
from hpcrl.inference.server.app import HEALTH_TIMEOUT_ENV, _flush_timeout, health_timeout_s
from hpcrl.inference.server.protocol import output_text, sample_rids
from hpcrl.inference.server.sampling import RequestError, SamplingParams
from hpcrl.inference.server.scheduler import Scheduler, Sequence
from tests.inference.sglang_wheel import Wheel, fetch_wheel

TOKENIZER_MANAGER = "srt/managers/tokenizer_manager.py"
QUIET = logging.getLogger("tests.sglang_rules")  # SGLang's functions log every truncation: not here
QUIET.disabled = True


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    return Wheel(fetch_wheel())


# ---- length ---------------------------------------------------------------------------------------------


class SGLangLengths:
    """SGLang's length rules for one request, run as SGLang runs them: the tokenizer manager's check, then the
    scheduler's cap on new tokens, then its input check. No KV pool smaller than the context."""

    def __init__(self, wheel: Wheel):
        stand_ins = {
            "logger": QUIET,
            "get_exec": lambda: NS(features=NS(enable_encoder_swa_bounded_replay=False)),
            "GenerateReqInput": type("GenerateReqInput", (), {}),  # the request below is neither: length only
            "EmbeddingReqInput": type("EmbeddingReqInput", (), {}),
        }
        self.validate_one = wheel.function(TOKENIZER_MANAGER, "_validate_one_request", stand_ins, "TokenizerManager")
        self.init_max_new = wheel.function(
            "srt/managers/scheduler.py", "init_req_max_new_tokens", {"logger": QUIET}, "Scheduler"
        )
        self.for_memory = wheel.function(
            "srt/mem_cache/allocator/base.py", "max_new_tokens_for_memory", {}, "BaseTokenToKVPoolAllocator"
        )
        self.validate_input = wheel.function("srt/managers/utils.py", "validate_input_length", {"logger": QUIET})
        self.wheel = wheel
        self._sizes: dict[tuple[int, int], tuple[int, int]] = {}

    def sizes(self, context: int, kv_tokens: int) -> tuple[int, int]:
        """(max_req_len, max_req_input_len), as the TP worker computes them at start-up."""
        if (context, kv_tokens) not in self._sizes:
            given = {"self": NS(model_config=NS(context_len=context)), "kv_capacity": kv_tokens}
            names = ["max_req_len", "max_req_input_len"]
            tp_worker = "srt/managers/tp_worker.py"
            space = self.wheel.assignments(tp_worker, "get_worker_info", names, given, "TpModelWorker")
            self._sizes[context, kv_tokens] = space["max_req_len"], space["max_req_input_len"]
        return self._sizes[context, kv_tokens]

    def serve(self, context: int, prompt: int, max_new: int, truncate: bool) -> str | tuple[int, int]:
        """SGLang's 400 message, or (prompt tokens, new tokens at most) of what it runs."""
        kv_tokens = 4 * context
        max_req_len, max_req_input_len = self.sizes(context, kv_tokens)
        tokenizer = NS(
            context_len=context,
            num_reserved_tokens=0,  # compute_num_reserved_tokens() without speculative decoding
            allow_auto_truncate=truncate,
            validate_total_tokens=True,
            _validate_joint_schema_request=lambda obj, ids: None,
        )
        obj, ids = NS(sampling_params={"max_new_tokens": max_new}), list(range(prompt))
        try:
            self.validate_one(tokenizer, obj, ids)
        except ValueError as e:
            return str(e)
        allocator = NS(page_size=1)
        allocator.max_new_tokens_for_memory = functools.partial(self.for_memory, allocator)
        scheduler = NS(
            max_new_tokens_limit=None,
            max_req_len=max_req_len,
            max_total_num_tokens=kv_tokens,
            kv_shard_widening=1,
            page_size=1,
            token_to_kv_pool_allocator=allocator,
            sliding_window_size=None,
            chunked_prefill_size=None,
        )
        params = NS(max_new_tokens=obj.sampling_params["max_new_tokens"], min_new_tokens=0)
        req = NS(rid="r", origin_input_ids=ids, sampling_params=params, set_finish_with_abort=_unexpected_abort)
        self.init_max_new(scheduler, req)  # Scheduler.handle_generate_request: this first, then the input check
        error = self.validate_input(req, max_req_input_len, truncate)
        return error or (len(req.origin_input_ids), req.sampling_params.max_new_tokens)


def _unexpected_abort(message: str) -> None:
    raise AssertionError(f"SGLang's KV budget refused the request: {message}")


def hpcrl_serves(context: int, prompt: int, max_new: int, truncate: bool) -> str | tuple[int, int]:
    """What hpcrl's CPU server does with the request (``Server.admit``), in the same terms."""
    problem = fit(prompt, max_new, context)
    return problem if problem and not truncate else served(prompt, max_new, context)


@pytest.fixture(scope="module")
def sglang(wheel) -> SGLangLengths:
    return SGLangLengths(wheel)


@pytest.mark.parametrize("truncate", [False, True], ids=["refuse", "auto-truncate"])
@pytest.mark.parametrize("context", [8, 16, 64])
def test_the_length_rules_are_sglangs_for_every_prompt_and_max_new_tokens(sglang, context, truncate):
    differ = []
    for prompt in range(1, context + 3):
        for max_new in range(context + 3):
            theirs = sglang.serve(context, prompt, max_new, truncate)
            mine = hpcrl_serves(context, prompt, max_new, truncate)
            if theirs != mine:
                differ.append((prompt, max_new, theirs, mine))
    assert differ == [], f"(prompt, max_new_tokens, SGLang, hpcrl), first of {len(differ)}: {differ[:5]}"


def test_the_margin_and_the_early_stop_in_numbers(sglang):
    """What the rules above come to, for a reader: SGLang's own numbers for a context of 512."""
    assert sglang.sizes(512, 4 * 512) == (511, 506) and max_input_len(512) == 506
    assert sglang.serve(512, 505, 7, False) == (505, 5) == served(505, 7, 512), "the longest prompt: 2 short"
    assert (
        sglang.serve(512, 506, 1, False)
        == fit(506, 1, 512)
        == (
            "Input length (506 tokens) exceeds the maximum allowed length (506 tokens). Use a shorter input or enable "
            "--allow-auto-truncate."
        )
    )
    assert sglang.serve(512, 502, 10, False) == (502, 8), "prompt + max_new_tokens = context stops 2 tokens early"


# ---- rids -----------------------------------------------------------------------------------------------


def sglang_rids(io_struct, **body) -> list[str] | str:
    """The rids SGLang's ``GenerateReqInput`` makes of a body (``normalize_batch_and_arguments``'s rid steps,
    in its order), or its error message."""
    req = io_struct.GenerateReqInput(**body)
    try:
        req._validate_inputs()
        req._determine_batch_size()
        req._handle_parallel_sampling()
        if req.is_single:
            req._normalize_single_inputs()
        else:
            req._normalize_rid(req.batch_size * req.parallel_sample_num)
        req._validate_rid_uniqueness()
    except ValueError as e:
        return str(e)
    return [req.rid] if req.is_single else req.rid


def hpcrl_rids(batch: int, n: int, single: bool, rid) -> list[list[str]] | str:
    try:
        return sample_rids(rid, batch, n, single)
    except RequestError as e:
        return str(e)


@pytest.mark.parametrize(
    ("input_ids", "rid"),
    [
        ([[1], [2], [3]], "g"),  # one string for a batch: g_0, g_1, g_2
        ([[1], [2]], ["a", "b"]),
        ([1], "one"),
        ([[1], [2]], ["a", "a"]),  # a duplicate: 400
        ([[1], [2]], ["a"]),  # too few: 400
        ([[1], [2], [3]], ["a", "b", "c", "d"]),  # too many: 400
        ([[1]], "g"),
    ],
)
def test_rids_are_normalised_as_sglangs_generate_req_input(wheel, input_ids, rid):
    io_struct = wheel.io_struct(["GenerateReqInput"])
    expected = sglang_rids(io_struct, input_ids=input_ids, rid=rid)
    single = not isinstance(input_ids[0], list)
    mine = hpcrl_rids(1 if single else len(input_ids), 1, single, rid)
    assert mine == expected if isinstance(expected, str) else [r for rids in mine for r in rids] == expected


def test_rids_without_one_are_fresh_and_n_samples_get_fresh_ones(wheel):
    """With ``n > 1`` SGLang checks the rids it normalised, then its tokenizer manager replaces every sample's
    (``_handle_batch_request``: ``regenerate_rid``); so an abort by the rid sent cannot reach them."""
    io_struct = wheel.io_struct(["GenerateReqInput"])
    n2 = {"sampling_params": {"n": 2}}
    assert sglang_rids(io_struct, input_ids=[[1], [2]], rid="g", **n2) == ["g_0", "g_1", "g_2", "g_3"]
    assert sglang_rids(io_struct, input_ids=[[1], [2]], rid=["a", "a"], **n2) == hpcrl_rids(2, 2, False, ["a", "a"])
    for rids in (hpcrl_rids(2, 2, False, "g"), hpcrl_rids(2, 1, False, None), hpcrl_rids(1, 1, True, None)):
        flat = [r for sample in rids for r in sample]
        assert all(re.fullmatch("[0-9a-f]{32}", r) for r in flat) and len(set(flat)) == len(flat), rids
    assert [len(sample) for sample in hpcrl_rids(2, 3, False, "g")] == [3, 3]


# ---- stops ----------------------------------------------------------------------------------------------


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


@pytest.mark.parametrize(
    ("output_ids", "finish_reason"),
    [
        ([0, 1, 2], {"type": "stop", "matched": 2}),  # a stop token: left out of text
        ([0, 1, 23, 24, 3, 23, 24], {"type": "stop", "matched": "xy"}),  # a stop string: cut at its first place
        ([0, 1, 2], {"type": "stop", "matched": "q"}),  # a matched string not in text (skipped tokens): as is
        ([0, 1, 2], {"type": "length", "length": 3}),
        ([0, 1], {"type": "abort", "message": "aborted"}),
        ([], {"type": "stop", "matched": 5}),
    ],
)
def test_the_text_is_trimmed_as_sglangs_detokenizer_trims_it(wheel, output_ids, finish_reason):
    trim = wheel.function("srt/managers/detokenizer_manager.py", "trim_matched_stop", {}, "DetokenizerManager")
    detokenizer = NS(is_tool_call_parser_gpt_oss=False, tool_close_token_ids=set())
    if output_ids:  # SGLang trims the ids it decodes, then the string (_decode_batch_token_id_output)
        ids = trim(detokenizer, list(output_ids), finish_reason, False)
        expected = trim(detokenizer, letters(ids), finish_reason, False)
    else:
        expected = ""  # SGLang asserts a stop token was generated; hpcrl's server never finishes so
    assert output_text(output_ids, finish_reason, letters) == expected


# ---- aborts ---------------------------------------------------------------------------------------------


LIVE = ["g7", "g70", "g8", "other"]


def sglang_aborts(wheel, rid: str | None) -> set[str]:
    """The rids SGLang aborts: its tokenizer manager forwards an ``AbortReq`` only for a rid it holds, and its
    scheduler then aborts every request whose rid starts with it (``Scheduler.abort_request``:
    ``req.rid.startswith(recv_req.rid)``, or all with ``abort_all``)."""
    sent: list = []
    abort = wheel.function(
        TOKENIZER_MANAGER,
        "abort_request",
        {"logger": QUIET, "get_serving": lambda: NS(tokenizer_worker_num=1), "AbortReq": NS},
        "TokenizerManager",
    )
    manager = NS(rid_to_state={r: NS(abort_sent=False) for r in LIVE}, _dispatch_to_scheduler=sent.append)
    manager.enable_metrics = False
    abort(manager, rid or "", abort_all=rid is None)
    return {r for req in sent for r in LIVE if req.abort_all or r.startswith(req.rid)}


def hpcrl_aborts(rid: str | None) -> set[str]:
    async def run() -> set[str]:
        scheduler = Scheduler(runner=None)
        loop = asyncio.get_running_loop()
        sequences = [Sequence(r, [1], SamplingParams(), loop.create_future()) for r in LIVE]
        scheduler.waiting.extend(sequences[:2])
        scheduler.running.update(enumerate(sequences[2:]))
        scheduler.abort(rid)
        return {seq.rid for seq in sequences if seq.abort_requested}

    return asyncio.run(run())


@pytest.mark.parametrize("rid", ["g", "g7", "g70", "g7-", "missing", None])
def test_an_abort_reaches_what_sglangs_reaches(wheel, rid):
    assert hpcrl_aborts(rid) == sglang_aborts(wheel, rid)


# ---- flush_cache and health -----------------------------------------------------------------------------


def test_flush_cache_takes_the_timeouts_sglangs_route_declares(wheel):
    """``flush_cache(timeout: float = Query(0.0, ge=0.0))``: FastAPI refuses the rest, and SGLang's handler
    makes that a 400."""
    tree = ast.parse(wheel.source("srt/entrypoints/http_server.py"))
    route = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "flush_cache")
    query = route.args.defaults[0]
    assert ast.unparse(query.func) == "Query" and ast.literal_eval(query.args[0]) == 0.0
    ge = next(ast.literal_eval(k.value) for k in query.keywords if k.arg == "ge")
    for raw in ("-1", "-0.001", "0", "0.25", "nan", "soon"):
        refused = not (_number(raw) >= ge)
        answer = _flush_timeout(raw)
        assert (getattr(answer, "status", None) == 400) == refused, raw
    assert _flush_timeout("0") == 0.0 and _flush_timeout("2.5") == 2.5


def _number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        return float("nan")


@pytest.mark.parametrize("environ", [{}, {HEALTH_TIMEOUT_ENV: "3"}])
def test_the_health_timeout_is_sglangs(wheel, environ):
    given = {"os": NS(getenv=environ.get)}
    space = wheel.assignments("srt/entrypoints/http_server.py", None, ["HEALTH_CHECK_TIMEOUT"], given)
    assert health_timeout_s(environ) == space["HEALTH_CHECK_TIMEOUT"]
    with pytest.raises(ValueError, match=f"{HEALTH_TIMEOUT_ENV}='1.5' must be a whole number of seconds"):
        health_timeout_s({HEALTH_TIMEOUT_ENV: "1.5"})
