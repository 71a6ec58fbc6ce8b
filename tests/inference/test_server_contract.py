"""The CPU server holds requests to SGLang 0.5.23's contract, with SGLang's status codes and messages.

Every test here is one way in which a server more lenient than SGLang would hide a bug that a GPU run
meets first: the context length, health while paused, the cache flush, aborts by rid prefix, the
weight-update session, and control bodies of the wrong shape.
"""

import threading
import time
import urllib.error
import urllib.request

import pytest

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
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_allow_auto_truncate_cuts_the_new_tokens_instead(tiny_model, tmp_path):
    server = ServerProc(
        tiny_model, tmp_path / "server.log", "127.0.0.1", "--context-length", "16", "--allow-auto-truncate"
    )
    try:
        body = {"input_ids": [5] * 12, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
        status, answer = server.post("/generate", body)
        assert status == 200 and answer["meta_info"]["completion_tokens"] == 4  # 16 - 12
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        assert server.get("/model_info")[1]["context_length"] == 16
    finally:
        server.stop()


# ---- health, flush, abort -------------------------------------------------------------------------------


def test_health_is_503_while_paused_and_200_after_continue(long_server):
    server = long_server
    assert status_of(server, "/health") == 200
    assert server.post("/pause_generation", {"mode": "abort"})[0] == 200
    try:
        assert status_of(server, "/health") == 503, "SGLang's health generation cannot run while paused"
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


def test_abort_request_matches_rids_by_prefix_and_abort_all_ends_the_rest(long_server):
    server = long_server
    running = {rid: in_background(server, long_request(rid)) for rid in ("group7-0", "group7-1", "group70", "other")}
    wait_running(server)
    status, answer = server.post("/abort_request", {})
    assert (status, answer) == (200, ""), "an empty rid without abort_all aborts nothing, as in SGLang"
    assert server.post("/abort_request", {"rid": "group7-"}) == (200, "")
    for rid in ("group7-0", "group7-1"):
        running[rid][0].join(60)
        assert running[rid][1]["r"][1]["meta_info"]["finish_reason"]["type"] == "abort", rid
    assert running["group70"][0].is_alive() and running["other"][0].is_alive(), "only the prefix is aborted"
    assert server.post("/abort_request", {"abort_all": True})[0] == 200
    for rid in ("group70", "other"):
        running[rid][0].join(60)
        assert running[rid][1]["r"][1]["meta_info"]["finish_reason"]["type"] == "abort", rid


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
