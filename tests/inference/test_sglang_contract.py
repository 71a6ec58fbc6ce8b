"""Every request body hpcrl sends, checked against SGLang 0.5.23's own request classes, not against the CPU server.

The CPU server stands in for SGLang in every other test, so a body it accepts and SGLang refuses would pass
them all. Here the real ``InferenceClient``, a real rollout workflow and the controller's ``WeightSync``
talk to recording servers (``test_client_fakes.FakeServer``) on every path hpcrl has: generation (a seeded
episode, batches, a batch cut to the context), health, model info, cache flush, aborts, pause and continue,
weight updates from disk and over the group (init, begin, buckets, end, destroy). Each recorded request is
then checked against what the wheel of SGLang 0.5.23 declares (``sglang_wheel.py`` loads it without
installing SGLang, which needs CUDA):

- the route exists with that method (``srt/entrypoints/http_server.py``);
- the body validates, as FastAPI validates it, against the route's request class (``io_struct.py``), and
  ``/generate`` also passes SGLang's JSON contract gate (``api/v1/api_types.py``'s ``GenerateRequest``);
- no body field is one the class lacks (SGLang would ignore it silently), and a route that takes no body
  gets none, while one that requires a body gets one.

The wheel is downloaded with pip (cached in the temp directory); when it cannot be, the tests fail saying
so: they never skip.
"""

import asyncio
from pathlib import Path
from typing import Any

import pytest

from hpcrl.config.schema import Config
from hpcrl.controller.weights import WeightSync
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.sglang_api import ENDPOINTS
from hpcrl.models.tiny import make_tokenizer
from hpcrl.reward.outcome import RewardOutcome
from hpcrl.rollout.workflows import make_workflow
from tests.inference.sglang_wheel import Wheel, fetch_wheel, fields_of
from tests.inference.test_client_fakes import fake_servers

SPECS = [  # what trainers report for the tiny model: (name, dtype, shape), in push order
    ("model.embed_tokens.weight", "bfloat16", [99, 64]),
    ("model.layers.0.self_attn.q_proj.weight", "bfloat16", [64, 64]),
    ("model.layers.0.self_attn.q_proj.bias", "bfloat16", [64]),
    ("model.norm.weight", "bfloat16", [64]),
]


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    return Wheel(fetch_wheel())


@pytest.fixture(scope="module")
def routes(wheel):
    return wheel.routes()


@pytest.fixture(scope="module")
def io_struct(wheel, routes):
    classes = sorted({routes[path]["body"] for _, path in ENDPOINTS if routes.get(path, {}).get("body")})
    return wheel.io_struct(classes)


@pytest.fixture(scope="module")
def per_server(tmp_path_factory) -> list[list[tuple[str, str, Any]]]:
    """Each server's (method, path, body) of every request hpcrl sent it, on every path; two servers of
    tensor-parallel size 2."""
    work = tmp_path_factory.mktemp("contract")

    async def drive():
        async with fake_servers(2) as fakes:
            await every_path([f.address for f in fakes], work)
            return [list(fake.calls) for fake in fakes]

    return asyncio.run(asyncio.wait_for(drive(), 60))


@pytest.fixture(scope="module")
def recorded(per_server) -> list[tuple[str, str, Any]]:
    return [call for calls in per_server for call in calls]


class Rewards:
    async def score(self, items):
        return [RewardOutcome(1.0) for _ in items]


class Trainers:
    """The trainer side of a weight sync, as the controller's ``Trainers`` answers it (no torch involved)."""

    async def host_weight_group(self, timeout_s: float) -> tuple[str, int, str]:
        return "10.0.0.7", 29517, "nccl"

    async def join_weight_group(self, world_size: int, timeout_s: float) -> None:
        return None

    async def weight_specs(self, dtype: str) -> list[tuple[str, str, list[int]]]:
        return [(name, dtype, shape) for name, _, shape in SPECS]

    async def push_weights(self, version: int, dtype: str) -> None:
        return None

    async def export_for_servers(self, path: Path) -> None:
        path.mkdir(parents=True)


async def every_path(addresses: list[str], work: Path) -> None:
    cfg = Config()
    cfg.rollout.stop = ["\n"]
    cfg.algorithm.group_size = 2
    options = {"tp_size": 2, "context_length": 64, "context_overflow": "truncate"}
    async with InferenceClient(addresses, **options) as client:
        await client.wait_healthy(timeout_s=5)
        resumed = asyncio.Event()
        resumed.set()
        workflow = make_workflow(cfg, client, make_tokenizer(), Rewards(), resumed)
        await workflow.run("3+4=", "7", seed=11)  # the rollout's requests: sampling params, seeds, logprobs
        await workflow.run("3+4=", "7")
        await client.generate([5, 6], {"max_new_tokens": 3}, rid="episode-1-0", return_logprob=False)
        await client.generate_many([[5, 6], [7]], {"max_new_tokens": 2, "temperature": 0})
        await client.generate_many([[5] * 56, [7]], {"max_new_tokens": 10})  # one cut to the context: a list
        await client.model_info()
        await client.flush_cache()
        await client.abort("episode-1-0")
        await client.abort()
        for mode in ("abort", "retract", "in_place"):
            await client.pause(mode)
            await client.resume()
        group = WeightSync("distributed", client, Trainers(), resumed, work / "weights", dtype="bfloat16")
        group.bucket_bytes = 64 * 64 * 2 + 64 * 2  # several calls, one of two tensors
        await group.setup()
        await group.push(1)
        await group.close()
        disk = WeightSync("disk", client, Trainers(), resumed, work / "weights")
        await disk.push(2)
        await client.update_weights_from_disk(str(work / "weights" / "v000002"), 2, servers=addresses[:1])  # restart


def test_every_endpoint_hpcrl_calls_is_a_route_of_sglang_with_that_method(routes):
    absent = [f"{m} {p}" for m, p in ENDPOINTS if m not in routes.get(p, {}).get("methods", set())]
    assert absent == [], f"SGLang 0.5.23 serves no {absent}"


def test_every_path_of_hpcrl_was_driven(recorded):
    assert {(method, path) for method, path, _ in recorded} == set(ENDPOINTS)


def test_every_request_body_validates_against_sglangs_own_request_class(recorded, routes, io_struct, wheel):
    from pydantic import TypeAdapter

    api = wheel.module("api/v1/api_types.py")
    problems = []
    for method, path, body in recorded:
        route = routes[path]
        problem = check(route, body, io_struct, api, TypeAdapter)
        if problem:
            problems.append(f"{method} {path} {body}: {problem}")
    assert problems == [], "\n".join(problems[:20])


def check(route: dict[str, Any], body: Any, io_struct, api, adapter) -> str:
    """What SGLang would make of this body: "" when it takes it as hpcrl means it."""
    if route["body"] is None:
        return "" if body is None else "SGLang reads no body here; hpcrl sent one, which it ignores"
    if body is None:
        return f"SGLang requires a body ({route['body']}); hpcrl sent none (HTTP 400)" if route["required"] else ""
    cls = getattr(io_struct, route["body"])
    try:
        adapter(cls).validate_python(body)
    except Exception as e:  # pydantic's ValidationError, or the class's own check
        return f"{route['body']} refuses it: {e}"
    unknown = sorted(set(body) - fields_of(cls))
    if unknown:
        return f"{route['body']} has no field {unknown}: SGLang would ignore it silently"
    if route["body"] == "GenerateReqInput":
        try:
            api.GenerateRequest.from_json_value(body)
        except api.JsonContractError as e:
            return f"SGLang's /generate contract gate refuses it: {e}"
    return ""


def test_the_checks_catch_what_sglang_refuses_or_ignores(routes, io_struct, wheel):
    """The validators above can fail: each of these is a body SGLang would refuse or silently misread."""
    from pydantic import TypeAdapter

    api = wheel.module("api/v1/api_types.py")
    bad = [
        ("/update_weights_from_disk", {"model_path": "/m", "weight_version": 7}, "refuses it"),  # not a string
        ("/update_weights_from_disk", {"model_path": "/m", "weight_verison": "7"}, "would ignore it silently"),
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["bfloat16"]}, "refuses it"),  # no shapes
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_token": 4}}, "contract gate refuses it"),
        ("/pause_generation", {"mode": "stop"}, "refuses it"),
        ("/end_weight_update", None, "requires a body"),
        ("/flush_cache", {}, "reads no body here"),
    ]
    for path, body, expected in bad:
        assert expected in check(routes[path], body, io_struct, api, TypeAdapter), (path, body)


def test_every_distributed_update_is_inside_a_weight_update_session(per_server):
    """SGLang refuses /update_weights_from_distributed outside begin..end; the rest of the group's order too."""
    for calls in per_server:
        paths = [path for _, path, _ in calls]
        group = [p for p in paths if "weight" in p and "disk" not in p]
        assert group[0] == "/init_weights_update_group" and group[-1] == "/destroy_weights_update_group"
        session = group[1:-1]
        assert session[0] == "/begin_weight_update" and session[-1] == "/end_weight_update", session
        assert set(session[1:-1]) == {"/update_weights_from_distributed"} and len(session) - 2 >= 2, session


def test_the_group_is_sized_by_tensor_parallel_ranks_and_the_buckets_by_dtype(recorded, per_server):
    joins = [body for _, path, body in recorded if path == "/init_weights_update_group"]
    assert sorted((j["rank_offset"], j["world_size"]) for j in joins) == [(1, 5), (3, 5)]
    assert {(j["master_address"], j["master_port"], j["backend"]) for j in joins} == {("10.0.0.7", 29517, "nccl")}
    for calls in per_server:
        pushes = [body for _, path, body in calls if path == "/update_weights_from_distributed"]
        assert [name for body in pushes for name in body["names"]] == [name for name, _, _ in SPECS]
        assert {d for body in pushes for d in body["dtypes"]} == {"bfloat16"}
        assert [body["flush_cache"] for body in pushes] == [False] * (len(pushes) - 1) + [True]


def test_a_wheel_that_cannot_be_fetched_fails_the_test_naming_why(tmp_path, monkeypatch):
    """No skip: CI without the wheel must go red, not quietly stop checking the contract."""
    import tests.inference.sglang_wheel as sglang_wheel

    monkeypatch.setattr(sglang_wheel, "CACHE", tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"cannot fetch the sglang==0\.0\.0\.dev0 wheel"):
        sglang_wheel.fetch_wheel("0.0.0.dev0")
    assert list(tmp_path.iterdir()) == [], "nothing half-downloaded is left to look like a wheel"
