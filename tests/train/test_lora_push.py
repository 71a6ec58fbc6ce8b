"""A LoRA policy's adapter reaches a live CPU server, by disk (the trainer's PEFT directory, /load_lora_adapter) and
in the body (/load_lora_adapter_from_tensors, as the controller sends it for train.weight_sync=distributed), and
the server then generates what the trainer's adapted model computes: the logprobs of its greedy completion equal
the trainer's to the tolerance of the full-weight check (test_weight_push.py), and differ from the base model's."""

import asyncio

import pytest
import torch
import torch.distributed as dist

from hpcrl.config.schema import InferenceConfig, LoRAConfig, TrainConfig
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.serve import start_server, stop_servers, wait_ready
from hpcrl.train.batch import Sequence
from hpcrl.train.dist import init_distributed
from hpcrl.train.engine import Engine
from hpcrl.train.weight_push import push_to_disk
from tests.inference.conftest import free_port
from tests.train.test_weight_push import LOGPROB_TOLERANCE

LORA = LoRAConfig(rank=4, alpha=8.0)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(tiny_model):
    created = not dist.is_initialized()
    engine = Engine(tiny_model, TrainConfig(lr=5e-2, micro_batch_tokens=256, lora=LORA), dist=init_distributed())
    engine.setup()
    batch = [Sequence([3, *PROMPT, 9, 10, 11], [0] * 5 + [1] * 3, advantage=1.0)]
    for _ in range(3):  # lora_B starts at zero: trained, the adapter moves the model away from its base
        engine.train_step(batch, lambda lp, mb, norm: (-(lp * mb.loss_mask).sum() / norm.tokens, {}))
    yield engine
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log_file = tmp_path_factory.mktemp("lora-server") / "server.log"
    where = {"bind_host": "127.0.0.1", "advertise_host": "127.0.0.1", "port": free_port(), "log_file": log_file}
    servers = [start_server("cpu", tiny_model, inference=InferenceConfig(), lora=LORA, **where)]
    try:
        asyncio.run(wait_ready(servers, timeout_s=120, poll_s=0.2))
        yield servers[0]
    finally:
        stop_servers(servers, grace_s=5)


async def greedy(address: str, adapter: str | None) -> tuple[list[int], list[float]]:
    async with InferenceClient([address], request_timeout_s=60) as client:
        result = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0}, lora_path=adapter)
        return result.output_ids, result.logprobs


def trainer_logprobs(engine: Engine, output_ids: list[int]) -> list[float]:
    ids = torch.tensor([PROMPT + output_ids])
    return engine.token_logprobs(ids, torch.ones_like(ids))[0, len(PROMPT) - 1 :].tolist()


def check_served(engine: Engine, address: str, adapter: str) -> None:
    output_ids, served = asyncio.run(greedy(address, adapter))
    gap = max(abs(a - b) for a, b in zip(served, trainer_logprobs(engine, output_ids), strict=True))
    assert gap < LOGPROB_TOLERANCE, f"the server's {adapter} is not the trainer's adapted model: {gap}"
    base_ids, base = asyncio.run(greedy(address, None))
    with engine.model.disable_adapter():  # the base model, as the trainer computes it
        base_gap = max(abs(a - b) for a, b in zip(base, trainer_logprobs(engine, base_ids), strict=True))
    assert base_gap < LOGPROB_TOLERANCE, "the base model's logprobs tell the measure apart from the adapter's"
    adapted_on_base = trainer_logprobs(engine, base_ids)
    assert max(abs(a - b) for a, b in zip(base, adapted_on_base, strict=True)) > 100 * LOGPROB_TOLERANCE


def test_a_disk_push_serves_the_trainers_adapted_model(engine, server, tmp_path):
    path = push_to_disk(engine, tmp_path / "v1")

    async def load() -> None:
        async with InferenceClient([server.address]) as client:
            await client.load_lora_adapter("disk", str(path))

    asyncio.run(load())
    check_served(engine, server.address, "disk")


def test_the_adapters_tensors_in_the_body_serve_the_trainers_adapted_model(engine, server):
    config, tensors = engine.adapter_config(), engine.adapter_tensors()

    async def load() -> None:
        async with InferenceClient([server.address]) as client:
            await client.load_lora_adapter_from_tensors("tensors", config, tensors)

    asyncio.run(load())
    check_served(engine, server.address, "tensors")


def test_a_second_push_under_the_same_name_serves_the_new_adapter(engine, server, tmp_path):
    """AdapterSync's order: unload the held adapter, load the new one under the same name (a server must not keep
    the first one's weights, nor reload them from its old path)."""

    async def load(path, unload: bool) -> None:
        async with InferenceClient([server.address]) as client:
            if unload:
                await client.unload_lora_adapter("policy")
            await client.load_lora_adapter("policy", str(path))

    asyncio.run(load(push_to_disk(engine, tmp_path / "v1"), unload=False))
    check_served(engine, server.address, "policy")
    batch = [Sequence([3, *PROMPT, 12, 13, 14], [0] * 5 + [1] * 3, advantage=1.0)]
    for _ in range(3):
        engine.train_step(batch, lambda lp, mb, norm: (-(lp * mb.loss_mask).sum() / norm.tokens, {}))
    asyncio.run(load(push_to_disk(engine, tmp_path / "v2"), unload=True))
    check_served(engine, server.address, "policy")
