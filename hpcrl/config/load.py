"""Read a run directory's resolved ``config.yaml`` back into a validated Config, without Hydra.

Workers on other nodes read the run's config from the shared run directory this way, so every
process of a run works from the very config the controller validated and wrote.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpcrl.config.checks import validate
from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config


def load_run_config(path: str | Path) -> Config:
    """The Config in ``path`` (a run directory's config.yaml), checked as at launch."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
        cfg = OmegaConf.to_object(merged)
    except (OSError, OmegaConfBaseException) as e:
        raise ConfigError(str(path), "<file>", f"a readable hpcrl config.yaml ({e})") from e
    assert isinstance(cfg, Config)
    return validate(cfg)


def dump_config(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
