"""The rollout/trainer mismatch of a batch: the gap between the servers' behaviour logprobs and the trainer's before
the step's first update, over loss tokens only, logged with decoupled PPO's proximal logprobs."""

import asyncio
import logging
import math
from dataclasses import replace

import pytest

from hpcrl.config.schema import Config
from hpcrl.controller.batch import to_sequences
from hpcrl.controller.mismatch import batch_mismatch
from hpcrl.rollout.workflows.base import Group, Sample
from hpcrl.rpc.messages import SequenceData
from tests.controller.test_job import metrics_of, run_job, summary_of
from tests.controller.test_loop import PolicyTrainers, make_loop, sequence


def test_a_batch_of_two_lengths_is_measured_on_its_loss_tokens_only():
    # lengths 3 and 2; token 0 is the prompt (mask 0), whose logprobs are junk that must not count
    short = replace(sequence(2), old_logprobs=[9.0, -1.0])
    long = replace(sequence(3), old_logprobs=[9.0, -2.0, -1.0])
    got = batch_mismatch([long, short], [[-9.0, -2.0 - 0.5, -1.0 + 0.25], [-9.0, -1.0 + math.log(3)]])
    d = [-0.5, 0.25, math.log(3)]  # the loss tokens' trainer - behaviour
    assert got["mismatch_abs_mean"] == pytest.approx(sum(map(abs, d)) / 3)
    assert got["mismatch_abs_max"] == pytest.approx(math.log(3))
    assert got["mismatch_kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert got["mismatch_out_frac"] == pytest.approx(1 / 3), "a ratio of 3 leaves [1/2, 2]"
    assert got["mismatch_seq_out_frac"] == pytest.approx(1 / 2)
    assert got["mismatch_seq_log_ratio"] == pytest.approx((-0.5 + 0.25 + math.log(3)) / 2)


def test_without_the_trainers_logprobs_there_is_nothing_to_measure():
    assert batch_mismatch([replace(sequence(3), old_logprobs=None)], [[-1.0] * 3]) == {}
    assert batch_mismatch([], []) == {}


def test_decoupled_ppo_logs_the_mismatch_of_the_policy_before_its_first_update(tmp_path):
    cfg = Config()
    cfg.algorithm = replace(cfg.algorithm, behavior_weight_cap=5.0, updates_per_batch=2)
    loop = make_loop(tmp_path, cfg, trainers=PolicyTrainers())
    metrics = {}
    batch = [sequence(n) for n in (3, 4, 5, 6)]  # behaviour -0.5 on every token; the policy before updates: -1.0
    asyncio.run(loop._train_on(batch, [2, 2], [1.0] * 4, metrics, step=1))
    assert metrics["mismatch_abs_mean"] == metrics["mismatch_abs_max"] == pytest.approx(0.5)
    assert metrics["mismatch_kl_k3"] == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert metrics["mismatch_out_frac"] == 0.0
    assert metrics["mismatch_seq_log_ratio"] == pytest.approx(-0.5 * (2 + 3 + 4 + 5) / 4)


class RecordingTrainers(PolicyTrainers):
    """PolicyTrainers that also record each update's loss masks and behaviour logprobs, report an in-step
    mismatch as the trainers' loss does, and count the servers' weight exports made without an update."""

    def __init__(self, prox: list[list[float]] | None = None):
        super().__init__()
        self.prox = prox  # per sequence, by its first token id (batch(): its index): the policy's logprobs
        self.masks: list[list[list[int]]] = []
        self.old_seen: list[list[float]] = []
        self.exports: list[str] = []

    async def compute_logprobs(self, shards):
        if self.prox is None:
            return await super().compute_logprobs(shards)
        return [[self.prox[s.input_ids[0]] for s in part] for part in shards]

    async def train_step(self, shards, export_to=""):
        self.masks.append([s.loss_mask for part in shards for s in part])
        self.old_seen.append([lp for part in shards for s in part for lp in s.old_logprobs])
        self.updates += 1
        return {"loss": 0.0, "mismatch_abs_mean": float(self.updates)}

    async def export_for_servers(self, path):
        self.exports.append(str(path))


def batch(count: int = 4) -> list[SequenceData]:
    """``count`` sequences of 3 tokens (1 prompt, 2 loss), each one's token ids its index in the batch."""
    return [replace(sequence(3), input_ids=[i] * 3) for i in range(count)]


def off_policy_loop(tmp_path, trainers, **off_policy):
    cfg = Config()
    cfg.algorithm = replace(cfg.algorithm, updates_per_batch=2)
    cfg.algorithm.off_policy = replace(cfg.algorithm.off_policy, **off_policy)
    return make_loop(tmp_path, cfg, trainers=trainers)


def test_mis_token_takes_the_rejected_tokens_out_of_the_loss_mask_before_the_update(tmp_path):
    # behaviour -0.5 everywhere; trainer ratios exp(d): 1 (kept), 3 (out of [1/2, 2]), 0.25 (out), 1.5 (kept)
    trainer = [[0.0, -0.5, -0.5 + math.log(3)], [0.0, -0.5 + math.log(0.25), -0.5 + math.log(1.5)]]
    trainer += [[0.0, -0.5, -0.5], [0.0, -0.5, -0.5]]
    trainers = RecordingTrainers(trainer)
    metrics = {}
    asyncio.run(off_policy_loop(tmp_path, trainers, kind="mis_token")._train_on(
        batch(), [2, 2], [1.0] * 4, metrics, step=1))  # fmt: skip
    assert trainers.masks[0] == [[0, 1, 0], [0, 0, 1]]
    assert trainers.masks[1] == [[0, 1, 1], [0, 1, 1]]
    assert metrics["off_policy_masked_frac"] == pytest.approx(2 / 8)
    assert metrics["mismatch_out_frac"] == pytest.approx(2 / 8), "measured on the masks before rejection"


def test_mis_sequence_rejects_whole_sequences_and_a_part_left_empty_is_not_trained_on(tmp_path):
    # the first part's two sequences have products 3 * 1 and 1 * 0.25: both out; the second part's are in
    trainer = [[0.0, -0.5 + math.log(3), -0.5], [0.0, -0.5, -0.5 + math.log(0.25)]]
    trainer += [[0.0, -0.5 + math.log(1.5), -0.5], [0.0, -0.5, -0.5]]
    trainers = RecordingTrainers(trainer)
    loop = off_policy_loop(tmp_path, trainers, kind="mis_sequence")
    metrics = {}
    asyncio.run(loop._train_on(batch(), [2, 2], [1.0] * 4, metrics, step=1, export_to="w"))
    assert trainers.updates == 1 and trainers.masks == [[[0, 1, 1], [0, 1, 1]]], "only the second part trains"
    assert loop.counters["updates_skipped"] == 1
    assert metrics["off_policy_masked_frac"] == pytest.approx(4 / 8)
    assert trainers.exports == [], "the last part trained and wrote the servers' weights itself"


def test_a_skipped_last_part_still_writes_the_servers_weights(tmp_path):
    trainer = [[0.0, -0.5, -0.5]] * 2 + [[0.0, -0.5 + math.log(3), -0.5]] * 2  # the second part is rejected
    trainers = RecordingTrainers(trainer)
    loop = off_policy_loop(tmp_path, trainers, kind="mis_sequence")
    asyncio.run(loop._train_on(batch(), [2, 2], [1.0] * 4, {}, step=1, export_to="w"))
    assert trainers.updates == 1 and trainers.exports == ["w"]


def test_tis_and_icepop_leave_the_loss_mask_as_it_is(tmp_path):
    for kind in ("tis", "icepop"):
        trainers = RecordingTrainers([[0.0, -0.5 + math.log(3), -0.5]] * 4)
        metrics = {}
        asyncio.run(off_policy_loop(tmp_path / kind, trainers, kind=kind)._train_on(
            batch(), [2, 2], [1.0] * 4, metrics, step=1))  # fmt: skip
        assert trainers.masks == [[[0, 1, 1]] * 2] * 2 and "off_policy_masked_frac" not in metrics


def test_recompute_trains_a_batch_without_server_logprobs_on_the_trainers_and_logs_no_mismatch(tmp_path, caplog):
    cfg = Config()
    cfg.algorithm = replace(cfg.algorithm, behaviour_logprobs="recompute", updates_per_batch=2)
    group = Group("p", "a", [5], [Sample([6, 7], None, [0, 0], "stop", reward=r) for r in (0.0, 1.0)])
    sequences = to_sequences([group] * 2, replace(cfg.algorithm, group_size=2))
    assert [s.old_logprobs for s in sequences] == [None] * 4, "the servers were asked for none"
    trainers = RecordingTrainers()  # it reports an in-step mismatch_abs_mean, which real ones do not under recompute
    metrics = {}
    with caplog.at_level(logging.INFO, logger="hpcrl.controller.mismatch"):
        loop = make_loop(tmp_path, cfg, trainers=trainers)
    asyncio.run(loop._train_on(sequences, [2, 2], [0.0, 1.0] * 2, metrics, step=1))
    assert trainers.old_seen == [[-1.0] * 6, [-1.0] * 6], "the policy before the first update, for every update"
    assert not [k for k in metrics if k.startswith("mismatch_")], metrics  # the trainers': test_loss_fn.py
    [line] = [r.getMessage() for r in caplog.records if "mismatch" in r.getMessage()]
    assert "behaviour_logprobs=recompute" in line and "not measured" in line


def test_with_server_logprobs_no_line_says_the_mismatch_is_unmeasured(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hpcrl.controller.mismatch"):
        make_loop(tmp_path, Config(), trainers=RecordingTrainers())
    assert not [r for r in caplog.records if "mismatch" in r.getMessage()]


def test_without_the_trainers_logprobs_the_first_updates_in_step_mismatch_is_kept(tmp_path):
    trainers = RecordingTrainers()
    metrics = {}
    results = asyncio.run(off_policy_loop(tmp_path, trainers)._train_on(
        batch(), [2, 2], [1.0] * 4, metrics, step=1))  # fmt: skip
    assert [r.get("mismatch_abs_mean") for r in results] == [1.0, None], "the second update's forward is after one"
    assert "mismatch_abs_mean" not in metrics


@pytest.mark.slow
def test_a_recompute_job_trains_with_real_trainers_on_batches_the_servers_gave_no_logprobs(tmp_path):
    overrides = ["run.trial=recompute", "run.max_steps=2", "algorithm.behaviour_logprobs=recompute"]
    summary = summary_of(run_job(tmp_path, *overrides, "eval.every_steps=0", "rollout.prompts_per_step=8"))
    run_dir = tmp_path / "default" / "recompute"
    metrics = metrics_of(run_dir)
    assert [m["step"] for m in metrics] == [1, 2] and summary["steps"] == 2
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert not [k for m in metrics for k in m if k.startswith("mismatch_")], metrics
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert log.count("behaviour_logprobs=recompute: the servers are asked for no logprobs") == 1
