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
