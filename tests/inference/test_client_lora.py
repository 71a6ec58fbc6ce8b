"""The inference client's LoRA calls: adapters loaded and unloaded on every server, refusals naming the server and
SGLang's reason, the tensors' serialization, and ``lora_path`` on generate requests.

Fake SGLang-like servers on real sockets (test_client_fakes.py); that SGLang's own classes and decoder take these
bodies is checked in test_sglang_contract.py.
"""

import base64
import pickle

import pytest
import torch

from hpcrl.inference.client import InferenceClient, InferenceError
from hpcrl.inference.client_lora import check_lora_update, checked_config, serialized_tensors
from tests.inference.test_client_fakes import fake_servers, run

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def adapter() -> dict[str, torch.Tensor]:
    return {A: torch.arange(32, dtype=torch.bfloat16).reshape(4, 8), B: torch.ones(8, 4, dtype=torch.bfloat16)}


def decoded(payload: str) -> dict[str, torch.Tensor]:
    return pickle.loads(base64.b64decode(payload, validate=True))


def test_adapters_load_and_unload_on_every_server_with_one_tensor_copy_per_rank():
    async def body():
        async with fake_servers(2) as fakes, InferenceClient([f.address for f in fakes], tp_size=2) as client:
            await client.load_lora_adapter("policy-v1", "/ckpt/adapter")
            await client.load_lora_adapter_from_tensors("policy-v2", CONFIG, adapter())
            await client.unload_lora_adapter("policy-v1")
            await client.load_lora_adapter("policy-v2", "/ckpt/adapter", servers=[fakes[1].address])  # restarted
            return fakes

    first, second = run(body())
    assert first.paths() == ["/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter"]
    assert second.paths() == [*first.paths(), "/load_lora_adapter"]
    for fake in (first, second):
        assert fake.bodies("/load_lora_adapter")[0] == {"lora_name": "policy-v1", "lora_path": "/ckpt/adapter"}
        assert fake.bodies("/unload_lora_adapter") == [{"lora_name": "policy-v1"}]
        pushed = fake.bodies("/load_lora_adapter_from_tensors")[0]
        assert set(pushed) == {"lora_name", "config_dict", "serialized_named_tensors"}
        assert (pushed["lora_name"], pushed["config_dict"]) == ("policy-v2", CONFIG)
        copies = pushed["serialized_named_tensors"]
        assert len(copies) == 2 and copies[0] == copies[1], "one copy per tensor-parallel rank"
        tensors = decoded(copies[0])
        assert list(tensors) == [A, B]
        for name, tensor in adapter().items():
            assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], tensor)
    assert first.adapters == {"policy-v2": "__tensor__"}


def test_a_refused_lora_call_names_the_server_and_sglangs_reason_and_is_not_retried():
    async def body():
        async with fake_servers(2) as [ok, refusing], InferenceClient([ok.address, refusing.address]) as client:
            refusing.success = False
            with pytest.raises(InferenceError) as caught:
                await client.load_lora_adapter("policy-v1", "/ckpt/adapter")
            assert refusing.paths() == ["/load_lora_adapter"], "a load is not retried: a second one would be refused"
            return refusing.address, caught.value

    address, error = run(body())
    assert error.server == address and error.status == 400 and error.endpoint == "/load_lora_adapter"
    assert str(error).endswith(f"on {address} failed with HTTP 400 (a 4xx is not retried): fake /load_lora_adapter "
                               "refused policy-v1")  # fmt: skip


def test_a_failure_answered_with_200_is_refused_with_its_message():
    check_lora_update("n:1", "/unload_lora_adapter", {"success": True, "error_message": None, "loaded_adapters": {}})
    answer = {"success": False, "error_message": "LoRA adapter 'x' is not loaded", "loaded_adapters": None}
    with pytest.raises(InferenceError, match=r"^POST /unload_lora_adapter on n:1 reported failure: LoRA adapter 'x'"):
        check_lora_update("n:1", "/unload_lora_adapter", answer)
    with pytest.raises(InferenceError, match="reported failure: Cache flushed"):
        check_lora_update("n:1", "/load_lora_adapter", "Cache flushed")


def test_generate_names_its_adapter_per_request_or_per_prompt():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address]) as client:
            await client.generate([5], {"max_new_tokens": 1}, lora_path="policy-v3")
            await client.generate([5], {"max_new_tokens": 1})
            await client.generate_many([[5], [6]], {"max_new_tokens": 1}, lora_path=["policy-v3", None])
            await client.generate_many([[5], [6]], {"max_new_tokens": 1}, lora_path="policy-v3")
            await client.generate_many([[5], [6]], {"max_new_tokens": 1}, lora_path=[None, None])
            with pytest.raises(ValueError, match="lora_path has 1 entries for 2 prompts"):
                await client.generate_many([[5], [6]], {"max_new_tokens": 1}, lora_path=["policy-v3"])
            with pytest.raises(ValueError, match="SGLang reads '' as the base model"):
                await client.generate([5], {"max_new_tokens": 1}, lora_path="")
            return [body.get("lora_path", "absent") for body in fake.bodies("/generate")]

    assert run(body()) == ["policy-v3", "absent", ["policy-v3", None], "policy-v3", "absent"]


def test_a_clients_adapter_is_named_by_every_request_that_names_none():
    async def body():
        async with fake_servers(1) as [fake], InferenceClient([fake.address], adapter="policy") as client:
            await client.generate([5], {"max_new_tokens": 1})
            await client.generate([5], {"max_new_tokens": 1}, lora_path="other")
            await client.generate_many([[5], [6]], {"max_new_tokens": 1})
            return [body.get("lora_path", "absent") for body in fake.bodies("/generate")]

    assert run(body()) == ["policy", "other", "policy"]
    with pytest.raises(ValueError, match="SGLang reads '' as the base model"):
        InferenceClient(["127.0.0.1:1"], adapter="")


def test_tensors_are_serialized_on_the_cpu_each_with_its_own_storage():
    big = torch.zeros(1000, 8)
    payload = serialized_tensors([(A, big[:4]), (B, big[:, :2].T)], copies=1)[0]
    assert len(payload) < 4 * 1000 * 8, "a view carries only its own elements, not its base's storage"
    tensors = decoded(payload)
    assert tensors[A].shape == (4, 8) and tensors[B].shape == (2, 1000) and tensors[B].is_contiguous()


class Sharded(torch.Tensor):  # stands for a DTensor: a tensor subclass SGLang's unpickler refuses
    pass


@pytest.mark.parametrize(
    ("named", "why"),
    [
        ({}, "named_tensors is empty"),
        ([(A, torch.ones(1)), (A, torch.ones(1))], f"names '{A}' twice"),
        ({A: torch.ones(2).as_subclass(Sharded)}, r"is a Sharded, expected a full torch.Tensor \(a DTensor's"),
        ({A: [1.0]}, "is a list, expected a full torch.Tensor"),
    ],
)
def test_tensors_sglang_cannot_decode_are_refused(named, why):
    with pytest.raises(ValueError, match=why):
        serialized_tensors(named, copies=1)


def test_an_adapter_config_that_is_not_json_is_refused():
    with pytest.raises(ValueError, match=r"config_dict must hold JSON values only.*target_modules as a list"):
        checked_config({**CONFIG, "target_modules": {"q_proj"}})  # PEFT's LoraConfig.to_dict() holds a set
    with pytest.raises(ValueError, match=r"adapter_config\.json as a dict, got a str"):
        checked_config("adapter_config.json")
