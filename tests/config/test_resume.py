"""What a resume may change (hpcrl.config.resume), on Config objects; the command line's side is in test_main.py."""

from dataclasses import replace

import pytest

from hpcrl.config import ConfigError
from hpcrl.config.resume import Change, changed_settings, check_changes
from hpcrl.config.schema import Config, ModelConfig, RecoverConfig, RunConfig
from hpcrl.rundir import RunDir


def test_the_model_path_is_compared_as_the_job_resolves_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = Config(model=ModelConfig(source="local", path=str(tmp_path / "m")))
    assert changed_settings(saved, Config(model=ModelConfig(source="local", path="m"))) == []
    # a tiny model's path is the one its first start made in the run directory, no setting
    made = Config(model=ModelConfig(path=str(tmp_path / "run" / "model")))
    assert changed_settings(made, Config()) == []
    assert changed_settings(saved, Config(model=ModelConfig(source="local", path="n"))) == [
        Change("model.path", str(tmp_path / "m"), str(tmp_path / "n"))
    ]


def test_where_the_run_is_and_how_this_start_begins_are_not_changes():
    new = Config(run=RunConfig(root="/elsewhere", dry_run=True), recover=RecoverConfig(mode="auto"))
    assert changed_settings(Config(), new) == []


def test_only_the_fixed_settings_are_refused(tmp_path):
    run_dir = RunDir(tmp_path)
    lr = Config(train=replace(Config().train, lr=1.0))
    assert check_changes(Config(), lr, run_dir) == [Change("train.lr", 5e-4, 1.0)]
    reward = replace(lr, reward=replace(lr.reward, fn="m:f"))
    with pytest.raises(ConfigError, match=r"^reward.fn='m:f' is invalid: expected 'hpcrl.reward.builtin:mod10', as"):
        check_changes(Config(), reward, run_dir)


def test_elastic_resume_keeps_the_lora_adapter_shape_and_changes_the_allocation(tmp_path):
    run_dir, lora = RunDir(tmp_path), replace(Config().train.lora, rank=8)
    adapter = Config(train=replace(Config().train, lora=lora))

    def resumed(**changed) -> Config:
        return replace(adapter, train=replace(adapter.train, lora=replace(lora, **changed)))

    # the trainers' load would fail on another shape and set every checkpoint aside as broken: refused before
    for changed, key in [({"rank": 16}, "train.lora.rank"), ({"alpha": 32.0}, "train.lora.alpha")]:
        with pytest.raises(ConfigError, match=rf"^{key}=.* a resume keeps the .* and LoRA adapter shape its"):
            check_changes(adapter, resumed(**changed), run_dir)
    with pytest.raises(ConfigError, match=r"^train.lora.rank=8 is invalid: expected 0, .*\(changed: train.lora.rank"):
        check_changes(Config(), adapter, run_dir)  # full weights to an adapter
    # dropout changes no weight; full weights have no adapter shape; trainers, servers, rollout workers may change
    assert check_changes(adapter, resumed(dropout=0.1), run_dir) == [Change("train.lora.dropout", 0.0, 0.1)]
    full_alpha = Config(train=replace(Config().train, lora=replace(Config().train.lora, alpha=32.0)))
    assert [c.key for c in check_changes(Config(), full_alpha, run_dir)] == ["train.lora.alpha"]
    allocation = Config().allocation
    elsewhere = replace(
        adapter,
        allocation=replace(
            allocation,
            trainer=replace(allocation.trainer, workers=1),
            server=replace(allocation.server, workers=3),
        ),
        rollout=replace(adapter.rollout, workers=2),
    )
    keys = ["allocation.server.workers", "allocation.trainer.workers", "rollout.workers"]
    assert [c.key for c in check_changes(adapter, elsewhere, run_dir)] == keys
