"""Distributed weight updates against two CPU servers of tensor-parallel size 2, in bfloat16, as on a GPU cluster.

This process plays trainer rank 0: it hosts the group's rendezvous (``host_store``), joins as rank 0 and
broadcasts a second model's weights; the real ``InferenceClient`` (``tp_size=2``) drives the servers.
Every rank of both servers joins (``rank_offset + tp_rank``), receives every tensor into a buffer of its
own and checks it against its rank 0's; rank 0 loads them. At the end, ``/update_weights_from_disk`` against
a float32 server: what the directory must hold, and an unpaused load with a request arriving meanwhile.
"""

import asyncio
import json
import shutil
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpcrl.inference.client import InferenceClient, InferenceError
from hpcrl.inference.weight_group import close_weight_group, host_store, open_weight_group, send_tensors
from hpcrl.inference.weight_layout import buckets, spec_bytes
from tests.inference.conftest import ServerProc, free_port

TP = 2
BUCKET_BYTES = 48 << 10  # the tiny model in bf16 is ~0.2 MB: several calls, some holding several tensors
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp-servers")
    procs = []
    try:
        for i in range(2):
            extra = ("--tp-size", str(TP), "--dtype", "bfloat16")
            procs.append(ServerProc(tiny_model, logs / f"server{i}.log", "127.0.0.1", *extra))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def trainer_weights(tiny_model_b):
    """The weights trainer rank 0 pushes: another seed's model, in float32 as an optimizer holds them."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_b, dtype=torch.float32)
    return {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}  # tied to the embedding


class Trainer:
    """Trainer rank 0 in this process: the rendezvous on this node first, then the group."""

    def __init__(self) -> None:
        self.port = free_port()
        self.store = host_store("127.0.0.1", self.port, timeout_s=TIMEOUT_S)
        self.group = None
        self.error: BaseException | None = None
        self._joining: threading.Thread | None = None

    def join(self, world_size: int, name: str = "weight_update_group") -> None:
        def run() -> None:
            try:
                self.group = open_weight_group(
                    "127.0.0.1", self.port, 0, world_size, name, timeout_s=TIMEOUT_S, store=self.store
                )
            except BaseException as e:
                self.error = e

        self._joining = threading.Thread(target=run)
        self._joining.start()

    async def alive(self) -> None:
        """Returns once rank 0 has joined; raises at once if it could not (the servers would wait for it)."""
        assert self._joining is not None
        while self._joining.is_alive():
            await asyncio.sleep(0.05)
        if self.group is None:
            raise RuntimeError(f"trainer rank 0 could not join the group: {self.error!r}")

    def joined(self):
        assert self._joining is not None
        self._joining.join(TIMEOUT_S)
        assert self.group is not None, "trainer rank 0 did not join the group"
        return self.group


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 2 * TIMEOUT_S))


def client_of(servers, tp_size: int = TP) -> InferenceClient:
    return InferenceClient([s.address for s in servers], tp_size=tp_size, weight_update_timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def group(servers):
    """The weight-update group of trainer rank 0 and every rank of both servers."""
    trainer = Trainer()

    async def form():
        async with client_of(servers) as client:
            world = client.weights_group_world_size()
            trainer.join(world)
            joining = client.init_weights_update_group("127.0.0.1", trainer.port, backend="gloo")
            assert (await asyncio.gather(joining, trainer.alive()))[0] == world
            return world

    world = run(form())
    yield trainer.joined(), world
    run(_destroy(servers))


async def _destroy(servers):
    async with client_of(servers) as client:
        await client.destroy_weights_update_group()


def test_every_tensor_parallel_rank_joins_a_group_of_five_at_its_offset(servers, group):
    pg, world = group
    assert world == pg.size() == 5  # trainer rank 0 + 2 servers x 2 ranks
    joined = [s.get("/model_info")[1]["weight_update_groups"]["weight_update_group"] for s in servers]
    assert joined == [{"ranks": [1, 2], "world_size": 5}, {"ranks": [3, 4], "world_size": 5}]


def test_a_push_outside_a_session_is_refused(servers, group, trainer_weights):
    name, tensor = next(iter(trainer_weights.items()))

    async def push():
        async with client_of(servers) as client:
            await client.update_weights_from_distributed([name], ["bfloat16"], [list(tensor.shape)], 1)

    with pytest.raises(InferenceError, match=r"must run between begin_weight_update\(\) and end_weight_update\(\)"):
        run(push())
    assert all(s.get("/model_info")[1]["weight_version"] == "default" for s in servers)


def test_a_bucketed_bf16_push_leaves_every_parameter_equal_to_the_trainers_cast(servers, group, trainer_weights):
    pg, _ = group
    specs = [(name, "bfloat16", list(t.shape)) for name, t in trainer_weights.items()]
    calls = buckets(specs, BUCKET_BYTES)
    assert len(calls) >= 3 and any(len(c) > 1 for c in calls), "the test needs several calls, some of several tensors"
    before = [s.get("/model_info")[1]["weight_update_calls"] for s in servers]

    async def push():
        async with client_of(servers) as client:
            await client.begin_weight_update()
            sending = asyncio.to_thread(send_tensors, pg, [t.to(torch.bfloat16) for t in trainer_weights.values()])
            await asyncio.gather(sending, _calls(client, calls))
            await client.end_weight_update()

    run(push())
    for server, calls_before in zip(servers, before, strict=True):
        info = server.get("/model_info")[1]
        assert info["weight_version"] == "4"
        assert info["weight_update_calls"] - calls_before == len(calls)
        # each call's receive buffers: in bf16 and at most one bucket, never the whole model as fp32
        assert info["weight_update_last_call_bytes"] == spec_bytes(calls[-1])
        assert info["weight_update_max_call_bytes"] <= max(BUCKET_BYTES, *(spec_bytes([s]) for s in specs))
        for name, tensor in trainer_weights.items():
            status, served = server.post("/get_weights_by_name", {"name": name, "truncate_size": tensor.shape[0]})
            assert status == 200
            assert torch.equal(torch.tensor(served), tensor.to(torch.bfloat16).float()), name
    # the server generates with the pushed weights (lm_head tied to the pushed embedding)
    assert servers[0].post("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})[0] == 200


async def _calls(client: InferenceClient, calls) -> None:
    for i, call in enumerate(calls):
        names, dtypes, shapes = zip(*call, strict=True)
        await client.update_weights_from_distributed(names, dtypes, shapes, 4, flush_cache=i == len(calls) - 1)


def test_a_group_sized_one_rank_per_server_is_refused_not_hung(servers, group):
    """The arithmetic of a client that ignores tp_size: 1 + 2 servers = 3, offsets 1 and 2. The second server's
    ranks 2..3 do not fit, and it says so at once instead of waiting for a rank that never comes."""
    trainer = Trainer()

    async def form():
        async with client_of(servers, tp_size=1) as client:
            trainer.join(3, "missized")  # with the first server's two ranks the group of 3 forms; the second is refused
            await client.init_weights_update_group("127.0.0.1", trainer.port, group_name="missized", backend="gloo")

    with pytest.raises(
        InferenceError, match=r"ranks rank_offset \+ tp_rank = 2\.\.3 \(tp_size 2\) are not within 1\.\.2"
    ):
        run(form())
    close_weight_group(trainer.joined())
    for _ in range(100):  # the first server's handler records the group once its ranks' joins return
        if "missized" in servers[0].get("/model_info")[1]["weight_update_groups"]:
            break
        time.sleep(0.1)

    async def leave():
        async with client_of(servers[:1]) as client:
            await client.destroy_weights_update_group("missized")

    run(leave())


# ---- from disk: what the directory must hold, and a load that holds new requests off -----------------------


@pytest.fixture(scope="module")
def disk_server(tiny_model, tmp_path_factory):
    """A float32 server of its own: these tests change its weights."""
    proc = ServerProc(tiny_model, tmp_path_factory.mktemp("disk-server") / "server.log")
    yield proc
    proc.stop()


def _weights(server, names) -> dict[str, torch.Tensor]:
    """The server's parameters, whole, through SGLang's /get_weights_by_name (float32 survives JSON exactly)."""
    out = {}
    for name in names:
        status, rows = server.post("/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})
        assert status == 200, rows
        out[name] = torch.tensor(rows, dtype=torch.float32)
    return out


def test_a_directory_without_the_weights_sglang_loads_is_refused_and_changes_nothing(
    disk_server, tiny_model, tiny_model_b, tmp_path
):
    server = disk_server
    names = [n for n in AutoModelForCausalLM.from_pretrained(tiny_model).state_dict() if n != "lm_head.weight"]
    before = _weights(server, names)
    version = server.get("/model_info")[1]["weight_version"]
    no_weights = tmp_path / "config-and-tokenizer-only"
    no_weights.mkdir()
    for f in tiny_model.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, no_weights / f.name)
    half = tmp_path / "half-a-sharded-model"
    half.mkdir()
    shutil.copy(tiny_model_b / "model.safetensors", half / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (half / "model.safetensors.index.json").write_text(json.dumps(index))
    refused = [
        (no_weights, f"Failed to get weights iterator: Cannot find any model weights with `{no_weights}`."),
        (
            tmp_path / "absent",
            f"Failed to get weights iterator: Cannot find any model weights with `{tmp_path}/absent`.",
        ),
        (half, "references 1 shard file(s) missing from"),
    ]
    for path, message in refused:
        status, answer = server.post("/update_weights_from_disk", {"model_path": str(path), "weight_version": "9"})
        assert status == 400 and not answer["success"] and message in answer["message"], answer
    assert server.get("/model_info")[1]["weight_version"] == version
    after = _weights(server, names)
    assert all(torch.equal(before[n], after[n]) for n in names), "a refused load changed the weights"
    # the weights file alone is enough, as for SGLang: no config or tokenizer file beside it
    alone = tmp_path / "weights-only"
    alone.mkdir()
    shutil.copy(tiny_model_b / "model.safetensors", alone / "model.safetensors")
    status, answer = server.post("/update_weights_from_disk", {"model_path": str(alone), "weight_version": "9"})
    assert status == 200 and answer["success"], answer
    expected = AutoModelForCausalLM.from_pretrained(tiny_model_b).state_dict()
    loaded = _weights(server, names)
    assert all(torch.equal(loaded[n], expected[n]) for n in names)


def test_an_unpaused_load_holds_new_requests_off_and_is_not_refused_for_them(long_server):
    """SGLang loads under its model-update lock: the running request ends on the old weights, one that comes
    meanwhile waits and runs on the new ones, and the cache flush has nothing to refuse for."""
    server = long_server
    results: dict[str, tuple[int, object]] = {}
    sent: dict[str, float] = {}

    def post(key: str, path: str, body: dict) -> threading.Thread:
        def send() -> None:
            sent[key] = time.monotonic()
            results[key] = server.post(path, body)
            sent[key + " answered"] = time.monotonic()

        thread = threading.Thread(target=send)
        thread.start()
        return thread

    # long enough to still run when the later request is sent, on a quiet machine too (800 tokens took under
    # 0.8 s there, and this test's precondition failed)
    held = {"text": "1+1=", "rid": "held", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    threads = [post("held", "/generate", held)]
    time.sleep(0.3)  # the request runs by then
    update = {"model_path": str(server.model), "weight_version": "11"}
    threads.append(post("update", "/update_weights_from_disk", update))
    time.sleep(0.2)
    later = {"text": "2+2=", "sampling_params": {"max_new_tokens": 3}}
    threads.append(post("later", "/generate", later))
    for thread in threads:
        thread.join(120)
    assert sent["later"] < sent["update answered"], "the held request ended before the later one was sent"
    assert results["update"][0] == 200 and results["update"][1]["success"], results["update"]
    status, answer = results["held"]
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length", answer
    assert answer["meta_info"]["weight_version"] != "11", "the running request ends on the old weights"
    status, answer = results["later"]
    assert status == 200 and answer["meta_info"]["weight_version"] == "11", answer
