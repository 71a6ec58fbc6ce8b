"""The CPU server holds requests to SGLang 0.5.23's contract, with SGLang's status codes and messages.

Every test here is one way in which a server more lenient than SGLang would hide a bug that a GPU run
meets first: the context length and its margins, rids, stops, health while paused, the cache flush, aborts,
the weight-update session, and control bodies of the wrong shape. Where SGLang's own code can run here, the
rule itself is checked against it in ``test_sglang_rules.py``; these tests check that the server follows it.
"""

import threading
import time
import urllib.error
import urllib.request

import pytest

from hpcrl.models.tokenizer import load_tokenizer
from tests.inference.conftest import ServerProc

LONG = 6000  # new tokens: runs for as long as a test needs it to
CONTEXT = 512  # the tiny model's max_position_embeddings


def status_of(server, path: str) -> int:
    try:
        with urllib.request.urlopen(f"{server.url}{path}", timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def post_text(server, path: str) -> tuple[int, str]:
    request = urllib.request.Request(f"{server.url}{path}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def in_background(server, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=server.post("/generate", body)))
    thread.start()
    return thread, result


def long_request(rid: str) -> dict:
    return {"text": "1+1=", "rid": rid, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}


def wait_running(server, seconds: float = 0.5) -> None:
    time.sleep(seconds)  # the request has reached the batch by then, on any machine load seen here


# ---- context length -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server(tiny_model, tmp_path_factory):
    """A 16-token context cut by --allow-auto-truncate, and SGLang's health timeout at 1 s."""
    log = tmp_path_factory.mktemp("small-server") / "server.log"
    extra = ("--context-length", "16", "--allow-auto-truncate")
    proc = ServerProc(tiny_model, log, "127.0.0.1", *extra, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"})
    yield proc
    proc.stop()


def test_a_prompt_over_the_context_length_is_refused_with_sglangs_400(server):
    assert server.get("/model_info")[1]["context_length"] == CONTEXT
    too_long = {"input_ids": [5] * 510, "sampling_params": {"max_new_tokens": 10}}
    status, answer = server.post("/generate", too_long)
    assert status == 400
    assert answer["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 512 tokens. You requested a total "
        "of 520 tokens: 510 tokens from the input messages and 10 tokens for the completion."
    )
    status, answer = server.post("/generate", {"input_ids": [5] * 512, "sampling_params": {"max_new_tokens": 1}})
    assert status == 400
    assert (
        answer["error"]["message"] == "The input (512 tokens) is longer than the model's context length (512 tokens)."
    )
    batch = {"input_ids": [[5] * 4, [5] * 510], "sampling_params": {"max_new_tokens": 10}}
    assert server.post("/generate", batch)[0] == 400, "one prompt over the context fails the whole batch"
    fits = {"input_ids": [5] * 502, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
    status, answer = server.post("/generate", fits)
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 8}, (
        "SGLang stops 2 tokens short of the context (Scheduler.init_req_max_new_tokens)"
    )


def test_a_prompt_within_sglangs_margin_of_the_context_is_refused(server):
    """SGLang's scheduler refuses a prompt of max_req_input_len = context - 1 - 5 tokens or more
    (managers/utils.py::validate_input_length), even when prompt + max_new_tokens fits."""
    status, answer = server.post("/generate", {"input_ids": [5] * 506, "sampling_params": {"max_new_tokens": 1}})
    assert status == 400
    assert answer["error"]["message"] == (
        "Input length (506 tokens) exceeds the maximum allowed length (506 tokens). Use a shorter input or enable "
        "--allow-auto-truncate."
    )
    longest = {"input_ids": [5] * 505, "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}}
    status, answer = server.post("/generate", longest)
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    chat = {"messages": [{"role": "user", "content": "x" * 506}], "max_tokens": 1}
    assert server.post("/v1/chat/completions", chat)[0] == 400, "the OpenAI routes hold the same margin"


def test_allow_auto_truncate_cuts_as_sglang_does(small_server):
    """The tokenizer manager cuts max_new_tokens to the context (12 + 4), the scheduler caps it 2 short of the
    context (2), then cuts the prompt to max_req_input_len (16 - 6 = 10)."""
    server = small_server
    body = {"input_ids": [5] * 12, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
    status, answer = server.post("/generate", body)
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert (answer["meta_info"]["prompt_tokens"], answer["meta_info"]["completion_tokens"]) == (10, 2)
    assert server.get("/model_info")[1]["context_length"] == 16


# ---- rids and stops -------------------------------------------------------------------------------------


def test_a_batch_with_one_rid_numbers_it_and_a_repeated_rid_is_refused(server):
    batch = {"input_ids": [[5], [6], [7]], "rid": "g", "sampling_params": {"max_new_tokens": 1}}
    status, answers = server.post("/generate", batch)
    assert status == 200 and [a["meta_info"]["id"] for a in answers] == ["g_0", "g_1", "g_2"]
    status, answer = server.post("/generate", {**batch, "rid": ["a", "b", "a"]})
    assert (status, answer["error"]["message"]) == (400, "Duplicate request IDs detected within the request: ['a']")
    status, answer = server.post("/generate", {**batch, "rid": ["a", "b"]})
    assert status == 400 and "rids length mismatch" in answer["error"]["message"]


def test_text_leaves_out_the_stop_token_and_the_stop_string_as_sglangs_does(server):
    """SGLang's detokenizer trims the matched stop from ``text`` (detokenizer_manager.py::trim_matched_stop)."""
    tok = load_tokenizer(server.model)
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7}  # seeded: the same tokens each time
    sampled = {"text": "hello", "sampling_params": {**params, "ignore_eos": True}}
    ids = server.post("/generate", sampled)[1]["output_ids"]
    k = next(  # the first token after the first that is plain text and new in the text
        (
            i
            for i in range(1, len(ids))
            if min(ids[: i + 1]) >= 3 and tok.decode(ids[i : i + 1]) not in tok.decode(ids[:i])
        ),
        None,
    )
    assert k is not None, f"seed 7 gave no token to stop at: {ids}"
    before, stop = tok.decode(ids[:k]), tok.decode(ids[k : k + 1])

    status, answer = server.post("/generate", {**sampled, "sampling_params": {**params, "stop_token_ids": [ids[k]]}})
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert answer["output_ids"] == ids[: k + 1] and answer["text"] == before, "the stop token only in output_ids"

    status, answer = server.post("/generate", {**sampled, "sampling_params": {**params, "stop": [stop]}})
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert answer["output_ids"] == ids[: k + 1] and answer["text"] == before, "the stop string is cut from text"

    ignored = {**sampled["sampling_params"], "stop_token_ids": [ids[k]]}
    status, answer = server.post("/generate", {**sampled, "sampling_params": ignored})
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 12}, (
        "ignore_eos turns off stop_token_ids too (schedule_batch.py::Req._check_token_based_finish)"
    )


# ---- health, flush, abort -------------------------------------------------------------------------------


def test_health_is_503_while_paused_after_sglangs_timeout_and_200_after_continue(small_server):
    """SGLang's health generation waits behind the pause and is given up after SGLANG_HEALTH_CHECK_TIMEOUT
    (http_server.py::health_generate): 503, but not before that delay (1 s for this server, 20 by default)."""
    server = small_server
    assert status_of(server, "/health") == 200
    assert server.post("/pause_generation", {"mode": "abort"})[0] == 200
    try:
        start = time.monotonic()
        assert status_of(server, "/health") == 503, "SGLang's health generation cannot run while paused"
        assert time.monotonic() - start >= 1.0, "SGLang answers 503 only after its health timeout"
    finally:
        assert server.post("/continue_generation", {})[0] == 200
    assert status_of(server, "/health") == 200


def test_flush_cache_is_refused_while_a_request_runs(long_server):
    server = long_server
    thread, result = in_background(server, long_request("flush-blocker"))
    wait_running(server)
    try:
        assert post_text(server, "/flush_cache") == (400, "Flush cache failed.\n")
        assert post_text(server, "/flush_cache?timeout=0.3") == (400, "Timed out waiting for idle state.")
    finally:
        server.post("/abort_request", {"rid": "flush-blocker"})
        thread.join(60)
    assert result["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    status, text = post_text(server, "/flush_cache")
    assert status == 200 and text.startswith("Cache flushed.")
    status, text = post_text(server, "/flush_cache?timeout=-1")
    assert status == 400 and "greater than or equal to 0" in text, "SGLang declares Query(0.0, ge=0.0)"


def test_abort_request_needs_a_rid_in_flight_and_abort_all_ends_the_rest(long_server):
    """SGLang's tokenizer manager forwards an abort only for a rid it holds (no prefix of it), and its scheduler
    then aborts every rid starting with that one (tokenizer_manager.py / scheduler.py ``abort_request``)."""
    server = long_server
    running = {rid: in_background(server, long_request(rid)) for rid in ("group7", "group70", "other")}
    wait_running(server)
    status, answer = server.post("/generate", long_request("other"))
    assert (status, answer["error"]["message"]) == (400, "Duplicate request ID detected: other"), "a rid in flight"
    assert server.post("/abort_request", {}) == (200, ""), "an empty rid without abort_all aborts nothing"
    assert server.post("/abort_request", {"rid": "group"}) == (200, ""), "no request holds rid 'group'"
    wait_running(server)
    assert all(thread.is_alive() for thread, _ in running.values()), "a prefix aborts nothing"
    assert server.post("/abort_request", {"rid": "group7"}) == (200, "")
    for rid in ("group7", "group70"):
        running[rid][0].join(60)
        assert running[rid][1]["r"][1]["meta_info"]["finish_reason"]["type"] == "abort", rid
    assert running["other"][0].is_alive()
    assert server.post("/abort_request", {"abort_all": True})[0] == 200
    running["other"][0].join(60)
    assert running["other"][1]["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"


# ---- the weight-update session and control bodies ----------------------------------------------------------


def test_the_weight_update_session_is_enforced(server):
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "weight_version": "5"}
    status, answer = server.post("/update_weights_from_distributed", update)
    assert status == 400 and answer == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
    }
    status, answer = server.post("/end_weight_update", {})
    assert status == 400 and answer["message"] == "no weight-update session is open; call begin_weight_update() first"
    assert server.post("/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    try:
        status, answer = server.post("/begin_weight_update", {})
        assert status == 400
        assert answer["message"] == "a weight-update session is already open; call end_weight_update() first"
        status, answer = server.post("/update_weights_from_distributed", update)  # in the session, but no group
        assert status == 400 and answer["message"].startswith("Failed to receive weights: Group weight_update_group")
    finally:
        assert server.post("/end_weight_update", {})[0] == 200
    assert server.get("/model_info")[1]["weight_version"] == "default", "nothing was loaded"


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/update_weights_from_disk", {"model_path": "/m", "weight_version": 7}, "'weight_version' must be a string"),
        (
            "/update_weights_from_disk",
            {"model_path": "/m", "weight_verison": "7"},
            "unknown field(s) ['weight_verison']",
        ),
        ("/update_weights_from_disk", {"model_path": "/m", "keep_pause": True}, "keep_pause=True is not supported"),
        ("/init_weights_update_group", {"master_address": "h", "master_port": "1"}, "'master_port' must be an integer"),
        ("/pause_generation", {"mode": "stop"}, "'mode' must be one of"),
        ("/begin_weight_update", {"selector": "both"}, "'selector' must be one of"),
        ("/abort_request", {"rid": 5}, "'rid' must be a string or null"),
    ],
)
def test_control_bodies_are_checked_against_sglangs_request_classes(server, path, body, message):
    status, answer = server.post(path, body)
    assert status == 400 and message in answer["error"]["message"], answer


@pytest.mark.parametrize("path", ["/pause_generation", "/continue_generation", "/end_weight_update"])
def test_control_requests_need_a_body_as_in_sglang(server, path):
    status, text = post_text(server, path)
    assert status == 400 and "needs a JSON object body" in text


def test_an_update_that_cannot_flush_the_cache_fails_as_in_sglang(long_server):
    """Paused in place, the running request stays; SGLang's flush after the load is refused, and so the call."""
    server = long_server
    thread, result = in_background(server, long_request("held"))
    wait_running(server)
    server.post("/pause_generation", {"mode": "in_place"})
    try:
        status, answer = server.post("/update_weights_from_disk", {"model_path": str(server.model)})
        assert status == 400 and answer["message"].startswith("Weights were updated, but the cache was not flushed")
        status, answer = server.post(
            "/update_weights_from_disk", {"model_path": str(server.model), "flush_cache": False}
        )
        assert status == 200 and answer["success"], answer
    finally:
        server.post("/continue_generation", {})
        server.post("/abort_request", {"rid": "held"})
        thread.join(60)
    assert result["r"][0] == 200
