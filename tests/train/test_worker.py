"""The trainer worker program under torchrun, driven over RPC as the controller drives it."""

import asyncio
import sys

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.config.load import dump_config
from hpcrl.config.schema import Config
from hpcrl.controller.trainers import Trainers
from hpcrl.launch.base import RoleSpec
from hpcrl.launch.local import LocalScheduler
from hpcrl.launch.slots import PortSlots
from hpcrl.rpc.auth import create_token
from hpcrl.rpc.client import RemoteError
from hpcrl.rpc.messages import SequenceData
from hpcrl.rundir import RunDir


def _sequence(n_prompt: int, n_out: int, advantage: float) -> SequenceData:
    ids = [4 + (i % 10) for i in range(n_prompt + n_out)]
    return SequenceData(
        input_ids=ids,
        loss_mask=[0] * n_prompt + [1] * n_out,
        advantage=advantage,
        old_logprobs=[0.0] * n_prompt + [-2.0] * n_out,
        prox_logprobs=None,
        ref_logprobs=None,
        versions=[-1] * n_prompt + [0] * n_out,
    )


@pytest.fixture
def trainer_run(tmp_path, tiny_model):
    cfg = Config()
    cfg.model.path = str(tiny_model)
    cfg.model.source = "local"
    cfg.allocation.trainer.gpus_per_worker = 0  # CPU ranks (gloo), as allocation=cpu_tiny has it
    run_dir = RunDir.create(tmp_path, "exp", "t")
    run_dir.write_config(dump_config(cfg))
    token = create_token(run_dir.path)
    spec = RoleSpec(
        "trainer",
        [sys.executable, "-m", "hpcrl.train.worker"],
        workers=2,
        torchrun=True,
        env={"OMP_NUM_THREADS": "1"},
        setup_timeout_s=180,
    )
    with LocalScheduler(run_dir, PortSlots({"trainer": 2}), grace_s=5) as scheduler:
        group = scheduler.start(spec)
        entries = group.wait_ready()
        yield run_dir, group, [e.address for e in entries], token


def test_trainer_ranks_serve_train_steps_export_and_shut_down(trainer_run):
    run_dir, group, addresses, token = trainer_run

    async def drive():
        async with Trainers(addresses, token, temperature=1.0) as trainers:
            shards = [[_sequence(4, 2, 1.0), _sequence(3, 2, -1.0)], [_sequence(5, 2, 0.5)]]
            metrics = await trainers.train_step(shards)
            assert metrics["step"] == 1 and metrics["sequences"] == 3 and metrics["loss_tokens"] == 6
            assert "time_weights_export_s" not in metrics, "no export was asked for"
            metrics = await trainers.train_step(shards, export_to=str(run_dir.path / "by_step"))
            assert metrics["step"] == 2 and metrics["time_weights_export_s"] > 0
            await trainers.export_for_servers(run_dir.path / "by_call")  # no update in between
            await trainers.export(run_dir.path / "export")
            specs = await trainers.weight_specs("bfloat16")  # in the servers' dtype
            assert "model.embed_tokens.weight" in [name for name, _, _ in specs]
            assert {dtype for _, dtype, _ in specs} == {"bfloat16"}
            with pytest.raises(RemoteError, match="rank 0"):
                await trainers.train_step([[], []])  # no loss tokens anywhere: a remote error, not a hang
            await trainers.shutdown()

    asyncio.run(asyncio.wait_for(drive(), 300))
    assert (run_dir.path / "export" / "config.json").is_file()
    by_step, by_call = (load_file(run_dir.path / d / "model.safetensors") for d in ("by_step", "by_call"))
    assert by_step.keys() == by_call.keys() and all(torch.equal(by_step[k], by_call[k]) for k in by_call), (
        "the train step's export holds the weights after its update, bit for bit"
    )
    assert sorted(p.name for p in (run_dir.path / "by_step").iterdir()) == ["model.safetensors"]
    for _ in range(100):
        try:
            group.check_alive()
        except Exception as e:  # torchrun exits once both ranks return from shutdown
            assert "exit code 0" in str(e) or "exited with 0" in str(e) or "code 0" in str(e), e
            break
        asyncio.run(asyncio.sleep(0.2))
    else:
        pytest.fail("the trainer ranks did not exit after shutdown")
