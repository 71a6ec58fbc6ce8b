"""The order of a LoRA push (hpcrl/controller/adapter_sync.py): generation paused, the held adapter unloaded, the new
one loaded under the same name and the servers' weight version set, then generation continued; by disk or in the
body; a restarted server loads the current adapter without an unload."""

import asyncio

import pytest
import torch

from hpcrl.controller.adapter_sync import AdapterSync
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.options import POLICY_ADAPTER
from tests.inference.test_client_fakes import fake_servers

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


class Trainers:
    """The trainer side: a disk export writes a directory; the adapter's tensors come in float32."""

    def __init__(self):
        self.calls: list[str] = []

    async def export_for_servers(self, path) -> None:
        self.calls.append(f"export {path.name}")
        path.mkdir(parents=True)

    async def lora_adapter(self):
        self.calls.append("adapter")
        return CONFIG, {"base_model.model.q_proj.lora_A.weight": torch.ones(2, 4)}


def run_pushes(mode: str, tmp_path, dtype="float32"):
    """setup, push(1), push(2) on two fake servers: each server's calls (path, body), and the trainers' calls."""

    async def drive():
        async with fake_servers(2) as fakes, InferenceClient([f.address for f in fakes], tp_size=2) as client:
            resumed = asyncio.Event()
            resumed.set()
            trainers = Trainers()
            sync = AdapterSync(mode, client, trainers, resumed, tmp_path / "weights", dtype=dtype)
            await sync.setup()
            await sync.push(1)
            await sync.push(2)
            assert resumed.is_set()
            await sync.close()
            loaded = await sync.load_current([fakes[1].address])  # a restarted server
            return [[(p, b) for _, p, b in f.calls if p != "/health"] for f in fakes], trainers.calls, loaded

    return asyncio.run(asyncio.wait_for(drive(), 30))


def test_a_disk_push_pauses_unloads_loads_the_new_directory_and_sets_the_version(tmp_path):
    per_server, trainers, loaded = run_pushes("disk", tmp_path)
    assert trainers == ["export v000000", "export v000001", "export v000002"]
    weights = tmp_path / "weights"
    first = per_server[0]
    expected = []
    for version in (0, 1, 2):
        expected += [("/pause_generation", {"mode": "abort"})]
        if version:  # the setup's load finds no adapter to unload
            expected += [("/unload_lora_adapter", {"lora_name": POLICY_ADAPTER})]
        path = str(weights / f"v{version:06d}")
        expected += [
            ("/load_lora_adapter", {"lora_name": POLICY_ADAPTER, "lora_path": path}),
            ("/update_weight_version", {"new_version": str(version), "abort_all_requests": False}),
            ("/continue_generation", {}),
        ]
    assert first == expected
    # the restarted server: the current adapter and its version, no unload (it holds none) and no pause
    assert per_server[1][len(expected) :] == expected[-3:-1]
    assert loaded == 2
    assert sorted(p.name for p in weights.iterdir()) == ["v000002"], "older exports are deleted"


def test_a_distributed_push_sends_the_tensors_in_the_servers_dtype_one_copy_per_rank(tmp_path):
    import base64
    import pickle

    per_server, trainers, _ = run_pushes("distributed", tmp_path, dtype="bfloat16")
    assert trainers == ["adapter"] * 3 and not (tmp_path / "weights").exists()
    loads = [b for p, b in per_server[0] if p == "/load_lora_adapter_from_tensors"]
    assert len(loads) == 3 and all(b["lora_name"] == POLICY_ADAPTER and b["config_dict"] == CONFIG for b in loads)
    copies = loads[0]["serialized_named_tensors"]
    assert len(copies) == 2  # tp_size
    tensors = pickle.loads(base64.b64decode(copies[0]))
    assert tensors["base_model.model.q_proj.lora_A.weight"].dtype == torch.bfloat16


def test_a_failed_load_still_continues_generation(tmp_path):
    async def drive():
        async with fake_servers(1) as fakes, InferenceClient([fakes[0].address]) as client:
            resumed = asyncio.Event()
            resumed.set()
            sync = AdapterSync("disk", client, Trainers(), resumed, tmp_path / "weights")
            fakes[0].success = False
            with pytest.raises(Exception, match="load_lora_adapter"):
                await sync.setup()
            return [p for _, p, _ in fakes[0].calls if p != "/health"], resumed.is_set()

    paths, resumed = asyncio.run(asyncio.wait_for(drive(), 30))
    assert paths[-1] == "/continue_generation" and resumed
