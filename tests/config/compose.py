"""Compose the real conf/ in-process, as hpcrl.main does."""

from hydra import compose, initialize_config_dir

from hpcrl.config.hydra import register_schema, to_config
from tests.conftest import CONF_DIR


def compose_config(*overrides: str):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def load(*overrides: str):
    return to_config(compose_config(*overrides))
