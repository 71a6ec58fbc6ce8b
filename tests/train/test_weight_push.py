"""Weight push: the tensor list in this process, and both push paths from real torchrun ranks to a real server.

``scripts/push_weights.py`` (2 ranks on gloo) trains the tiny model away from what a live CPU server holds,
pushes through the disk and then through the process group, and records what the server answered.
Server start and the torchrun launch take about 20 s together on 2 CPU cores, so these are not ``slow``.
"""

import asyncio
import json
import sys
import urllib.request

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from hpcrl.config.schema import InferenceConfig, TrainConfig
from hpcrl.inference.client import InferenceClient
from hpcrl.inference.serve import start_server, stop_servers, wait_ready
from hpcrl.train import engine as engine_module
from hpcrl.train.batch import Sequence
from hpcrl.train.dist import init_distributed
from hpcrl.train.engine import Engine
from hpcrl.train.weight_push import host_weight_group, join_weight_group, push_over_group, push_to_disk, weight_specs
from tests.conftest import REPO, run_torchrun
from tests.inference.conftest import free_port

SCRIPT = REPO / "tests" / "train" / "scripts" / "push_weights.py"
TIMEOUT_S = 240  # the script's collectives time out after 120 s, so a hang fails long before this
LOGPROB_TOLERANCE = 1e-4


# ---- weight_specs, in this process (a 1-rank gloo group, FSDP2-sharded as many ranks are) ---------------


@pytest.fixture(scope="module")
def engine(tiny_model):
    created = not dist.is_initialized()
    engine = Engine(tiny_model, TrainConfig(micro_batch_tokens=64), dist=init_distributed())
    with pytest.MonkeyPatch.context() as patch:  # one float32 rank alone would train the plain model
        patch.setattr(engine_module, "_shards", lambda world_size, mp_policy: True)
        engine.setup()
    assert isinstance(engine.model.get_input_embeddings().weight, DTensor)
    yield engine
    if created:
        dist.destroy_process_group()


def test_weight_specs_are_the_exported_tensors_in_state_dict_order(engine, tmp_path):
    specs = weight_specs(engine)
    export = engine.export_hf(tmp_path / "export")
    with safe_open(export / "model.safetensors", "pt") as f:
        saved = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        on_disk = {name: (s.get_dtype(), s.get_shape()) for name, s in saved.items()}
    assert {name for name, _, _ in specs} == set(on_disk)
    assert "lm_head.weight" not in on_disk, "the tiny model ties lm_head to the embedding"
    for name, dtype, shape in specs:
        assert (dtype, shape) == ("float32", on_disk[name][1]), name
        assert on_disk[name][0] == "F32"
    # the order is the state dict's, which is the server model's own, minus the tied head
    expected = [n for n in engine.full_state_dict() if n != "lm_head.weight"]
    assert [name for name, _, _ in specs] == expected
    server_model = AutoModelForCausalLM.from_pretrained(export)
    assert [n for n in server_model.state_dict() if n != "lm_head.weight"] == expected


def test_weight_specs_leave_sharding_alone_and_take_a_wire_dtype(engine):
    specs = weight_specs(engine)
    ids = torch.tensor([[5, 6, 7, 8]])
    engine.token_logprobs(ids, torch.ones_like(ids))
    unsharded = type(engine.model.get_input_embeddings().weight)
    assert unsharded is not DTensor, "FSDP2 keeps the root's parameters unsharded after a forward"
    # the same answer while FSDP2 holds the root's parameters unsharded after a forward, and no reshard:
    # state_dict() would reshard this rank alone, and the next forwards would all-gather out of step
    assert weight_specs(engine) == specs
    assert type(engine.model.get_input_embeddings().weight) is unsharded
    assert {dtype for _, dtype, _ in weight_specs(engine, torch.bfloat16)} == {"bfloat16"}
    assert weight_specs(engine, "bfloat16") == weight_specs(engine, torch.bfloat16)
    for bad in ("int8", "float33", torch.long):
        with pytest.raises(ValueError, match="floating-point torch dtype"):
            weight_specs(engine, bad)


def test_misuse_fails_on_every_rank_before_any_gather(engine):
    with pytest.raises(ValueError, match=r"this rank \(0\) passed None, expected the WeightGroup"):
        push_over_group(engine, None)
    with pytest.raises(ValueError, match="backend nccl needs the trainer on CUDA"):
        host_weight_group(engine, "127.0.0.1", free_port(), backend="nccl")
    with pytest.raises(ValueError, match="at the GroupHost that host_weight_group returned"):
        join_weight_group(engine, None, world_size=2)
    address = host_weight_group(engine, "127.0.0.1", free_port())
    assert address is not None and address.backend == "gloo", "a trainer on CPU picks gloo"
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        join_weight_group(engine, address, world_size=1)


# ---- both paths, torchrun ranks against a live server ---------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log_file = tmp_path_factory.mktemp("server") / "server.log"
    servers = [
        start_server(
            "cpu",
            tiny_model,
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            port=free_port(),
            log_file=log_file,
            inference=InferenceConfig(),
        )
    ]
    try:
        asyncio.run(wait_ready(servers, timeout_s=120, poll_s=0.2))
        yield servers[0]
    finally:
        stop_servers(servers, grace_s=5)  # by PID, the process tree


@pytest.fixture(scope="module")
def pushed(tiny_model, server, tmp_path_factory):
    out = tmp_path_factory.mktemp("push")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT)]
    args = [str(tiny_model), server.address, str(free_port()), str(out)]
    try:
        run_torchrun([*cmd, *args], TIMEOUT_S, "push_weights.py")
    except BaseException:
        print(f"server log:\n{server.child.log_tail()}")
        raise
    return [json.loads((out / f"result_rank{rank}.json").read_text()) for rank in (0, 1)]


def _check_push(phase: dict, version: str) -> None:
    print(
        f"version {version}: {phase['seconds']:.2f} s from push to loaded, max |server - reference| logprob "
        f"{phase['max_logprob_gap']:.3g}; first completion {phase['before'][0]} -> {phase['after'][0]}"
    )
    assert phase["after"] == phase["reference"], "the server must generate what the pushed model generates"
    assert phase["after"] != phase["before"], "the push changed nothing on the server, so equality would prove little"
    assert phase["max_logprob_gap"] < LOGPROB_TOLERANCE
    assert phase["version"] == version


def test_push_to_disk_reloads_the_server(pushed):
    disk = pushed[0]["disk"]
    _check_push(disk, "1")
    assert disk["pushed_files"] == ["model.safetensors"], "the sync writes the weights alone, no tokenizer or config"
    assert disk["pushed_is_the_export"], "the pushed tensors are export_hf's, bit for bit"


def test_several_disk_pushes_leave_the_servers_weights_the_trainers_bit_for_bit(engine, server, tmp_path):
    """In this process (1 rank: the gathered tensors are views of one buffer), three train-push-load rounds;
    after each, every parameter the server holds equals the trainer's, read back through /get_weights_by_name."""
    from hpcrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(engine.model_path)
    ids = tok("3+4=7")["input_ids"]
    batch = [Sequence(ids, [0, 0, 0, 0] + [1] * (len(ids) - 4), advantage=1.0)]
    for version in (1, 2, 3):
        engine.train_step(batch, _sft_loss)
        path = push_to_disk(engine, tmp_path / f"v{version}")
        assert sorted(p.name for p in path.iterdir()) == ["model.safetensors"], "the weights alone, every push"
        asyncio.run(_load(server.address, path, version))
        trainer = {n: t for n, t in engine.full_state_dict().items() if n != "lm_head.weight"}
        for name, tensor in trainer.items():
            held = torch.tensor(_post(server.address, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20}))
            assert torch.equal(held, tensor), f"push {version}: the server's {name} is not the trainer's"
    assert _post(server.address, "/model_info", None)["weight_version"] == "3"


def _sft_loss(logprobs, mb, norm):
    return -(mb.advantages[:, None] * logprobs * mb.loss_mask).sum() / norm.tokens, {}


async def _load(address: str, path, version: int) -> None:
    async with InferenceClient([address], request_timeout_s=60) as client:
        await client.update_weights_from_disk(str(path), version, abort_all_requests=True)


def _post(address: str, path: str, body):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{address}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_push_over_group_reaches_the_server(pushed):
    rank0, rank1 = pushed[0]["group"], pushed[1]["group"]
    _check_push(rank0, "2")
    assert (rank0["world_size"], rank0["backend"]) == (2, "gloo")
    assert rank1["group_is_none"], "only rank 0 joins the weight group"
    # the logprob measure tells weights apart: against the weights the server held before, it is large
    assert rank0["stale_logprob_gap"] > 100 * LOGPROB_TOLERANCE, rank0["stale_logprob_gap"]
    # every rank took part in one gather per tensor the server was told to expect, over several calls
    assert rank0["tensors"] == rank1["tensors"] == len(rank0["specs"])
    assert rank0["calls"] > 1, "the push went in one call: the bucket boundaries were not exercised"


def test_ranks_agree_on_the_specs_and_they_never_change(pushed):
    specs = pushed[0]["specs_at_setup"]
    assert pushed[1]["specs_at_setup"] == specs
    assert pushed[0]["group"]["specs"] == specs
    assert "lm_head.weight" not in {name for name, _, _ in specs}
