"""Every request body hpcrl sends, checked against SGLang 0.5.23's own request classes, not against the CPU server.

The CPU server stands in for SGLang in every other test, so a body it accepts and SGLang refuses would pass
them all. Here the real ``InferenceClient``, a real rollout workflow and the controller's ``WeightSync``
talk to recording servers (``test_client_fakes.FakeServer``) on every path hpcrl has: generation (a seeded
episode, batches, a batch cut to the context, requests naming a LoRA adapter), health, model info, cache flush,
aborts, pause and continue, weight updates from disk and over the group (init, begin, buckets, end, destroy),
LoRA adapters loaded from a directory and from tensors, and unloaded. Each recorded request is
then checked against what the wheel of SGLang 0.5.23 declares (``sglang_wheel.py`` loads it without
installing SGLang, which needs CUDA):

- the route exists with that method (``srt/entrypoints/http_server.py``);
- the body validates, as FastAPI validates it, against the route's request class (``io_struct.py``), and
  ``/generate`` also passes SGLang's JSON contract gate (``api/v1/api_types.py``'s ``GenerateRequest``);
- no body field is one the class lacks (SGLang would ignore it silently), and a route that takes no body
  gets none, while one that requires a body gets one;
- an adapter's tensors decode, on each tensor-parallel rank, through SGLang's own decoder (``common.py``'s
  ``MultiprocessingSerializer`` and ``SafeUnpickler``) into the tensors sent, and the client reads SGLang's
  own ``LoRAUpdateOutput`` answers.

The wheel is downloaded with pip (cached in the temp directory); when it cannot be, the tests fail saying
so: they never skip.
"""

import asyncio
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.config.schema import Config
from hpcrl.controller.weights import WeightSync
from hpcrl.inference.client import InferenceClient, InferenceError
from hpcrl.inference.client_http import _reason
from hpcrl.inference.client_lora import check_lora_update
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
ADAPTER_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none"}
LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def adapter_tensors() -> dict[str, torch.Tensor]:
    """A rank-2 adapter of the tiny model's q_proj, by PEFT's names, as the trainer hands it over."""
    a = torch.linspace(-1, 1, 2 * 64, dtype=torch.bfloat16).reshape(2, 64)
    return {LORA_A: a, LORA_B: torch.full((64, 2), 0.5, dtype=torch.bfloat16)}


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    return Wheel(fetch_wheel())


@pytest.fixture(scope="module")
def routes(wheel):
    return wheel.routes()


@pytest.fixture(scope="module")
def io_struct(wheel, routes):
    classes = sorted({routes[path]["body"] for _, path in ENDPOINTS if routes.get(path, {}).get("body")})
    return wheel.io_struct([*classes, "LoRAUpdateOutput"])


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
        await client.load_lora_adapter("policy-v1", str(work / "adapter"))
        await client.load_lora_adapter_from_tensors("policy-v2", ADAPTER_CONFIG, adapter_tensors())
        await client.generate([5, 6], {"max_new_tokens": 2}, lora_path="policy-v2")
        await client.generate_many([[5, 6], [7]], {"max_new_tokens": 2}, lora_path=["policy-v2", None])
        await client.unload_lora_adapter("policy-v1")
        await client.update_weight_version(3)
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
        ("/load_lora_adapter", {"lora_name": "a"}, "refuses it"),  # no lora_path
        ("/unload_lora_adapter", {"lora_name": "a", "lora_path": "/p"}, "would ignore it silently"),
        ("/update_weight_version", {"new_version": 3}, "refuses it"),  # not a string
        ("/update_weight_version", {"version": "3"}, "refuses it"),  # no new_version
        (
            "/load_lora_adapter_from_tensors",
            {"lora_name": "a", "config_dict": {}, "serialized_named_tensors": ["*"]},
            "refuses it",
        ),  # not base64
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "lora_path": 3}, "refuses it"),
    ]
    for path, body, expected in bad:
        assert expected in check(routes[path], body, io_struct, api, TypeAdapter), (path, body)


def test_an_adapters_tensors_decode_on_every_rank_through_sglangs_own_decoder(recorded, io_struct, wheel):
    """As SGLang reads the body: FastAPI's validation (base64 to bytes), the tokenizer manager's normalisation, then
    each tensor-parallel rank's ``MultiprocessingSerializer.deserialize`` of its own copy (``SafeUnpickler``)."""
    from pydantic import TypeAdapter

    decoder = wheel.tensor_decoder()
    bodies = [body for _, path, body in recorded if path == "/load_lora_adapter_from_tensors"]
    assert len(bodies) == 2, "one per server"
    for body in bodies:
        request = TypeAdapter(io_struct.LoadLoRAAdapterFromTensorsReqInput).validate_python(body)
        assert (request.lora_name, request.config_dict, request.load_format) == ("policy-v2", ADAPTER_CONFIG, None)
        payloads = decoder.normalize_serialized_named_tensor_payloads(request.serialized_named_tensors)
        assert len(payloads) == 2, "one copy per tensor-parallel rank (tp_size 2)"
        for rank in range(2):
            tensors = decoder.MultiprocessingSerializer.deserialize(payloads[rank])
            assert list(tensors) == [LORA_A, LORA_B]  # the dict SGLang's LoRA loader iterates
            for name, sent in adapter_tensors().items():
                assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], sent), name
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(posix\.system\)"):  # the decoder is SGLang's
        decoder.MultiprocessingSerializer.deserialize(pickle.dumps(__import__("os").system))


def test_sglangs_lora_answers_are_read_and_a_failure_names_its_reason(io_struct, wheel):
    """``LoRAUpdateOutput`` as SGLang's route writes it (``msgspec_to_builtins``): success passes; a failure (HTTP
    400, or 200 with success false) raises naming the server and SGLang's ``error_message``."""
    to_json = wheel.module("srt/utils/msgspec_utils.py").msgspec_to_builtins
    loaded = io_struct.LoRAUpdateOutput(success=True, loaded_adapters={"policy-v2": "__tensor__"})
    check_lora_update("n:1", "/load_lora_adapter", to_json(loaded))
    why = "Failed to load LoRA adapter policy-v2 because it is already loaded"
    refused = to_json(io_struct.LoRAUpdateOutput(success=False, error_message=why))
    assert _reason(json.dumps(refused)) == why, "what the client's HTTP 400 error says"
    with pytest.raises(InferenceError, match=f"^POST /load_lora_adapter on n:1 reported failure: {why}$"):
        check_lora_update("n:1", "/load_lora_adapter", refused)


def test_every_distributed_update_is_inside_a_weight_update_session(per_server):
    """SGLang refuses /update_weights_from_distributed outside begin..end; the rest of the group's order too."""
    for calls in per_server:
        paths = [path for _, path, _ in calls]
        group = [p for p in paths if ("weights" in p and "disk" not in p) or "weight_update" in p]
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
