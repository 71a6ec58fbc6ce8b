"""The Hydra edge: schema registration, DictConfig -> Config conversion, and the pre-launch check.

Below this module no code sees a DictConfig: ``to_config`` turns the composed config into plain
dataclasses once, validated. ``ValidateBeforeLaunch`` runs the same check in the submitting process
of a multirun (``-m``), so a bad config fails before any Slurm job is submitted.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from hpcrl.config.checks import validate
from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config

SCHEMA_NAME = "hpcrl_schema"
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the Hydra config groups, shipped in the package


def _first_set(*values: Any) -> Any:
    """The first value that is set ("" and 0 mean "unset" in hpcrl's config, e.g. cluster.controller.time_min)."""
    return next((v for v in values if v not in ("", 0, None)), None)


def _whole_gib(gb: Any) -> int | None:
    """Memory in whole GiB for Slurm (it refuses --mem=2.0G); 0 = the scheduler's default (None)."""
    return math.ceil(float(gb)) if float(gb) > 0 else None


# the controller job's options the submitit plugin takes by name; every other option is additional_parameters
_LAUNCHER_NAMED = {"partition": "partition", "account": "account", "qos": "qos", "constraint": "constraint"}
_LAUNCHER_OWN = {"job-name", "nodes", "ntasks-per-node", "cpus-per-task", "time", "mem"}  # set by other fields


def _controller_option(cluster: Any, name: str) -> Any:
    """One option of the controller's job, from the one function that decides them (``controller_resources``, which
    ``python -m hpcrl.sbatch controller`` renders too): ``partition``/``account``/``qos``/``constraint`` (None when
    unset), or ``additional`` for every other sbatch option (``extra_sbatch`` merged over the cluster's)."""
    from hpcrl.launch.slurm.scripts import controller_resources

    cfg = OmegaConf.to_object(cluster) if isinstance(cluster, DictConfig) else cluster
    options = controller_resources(cfg, "").sbatch_options()
    if name == "additional":
        return {k: v for k, v in options.items() if k not in _LAUNCHER_OWN and k not in _LAUNCHER_NAMED}
    return options.get(_LAUNCHER_NAMED[name])


# for conf/hydra/launcher: registered on import, which the submitting process and the job both do
OmegaConf.register_new_resolver("hpcrl.first", _first_set, replace=True)
OmegaConf.register_new_resolver("hpcrl.gib", _whole_gib, replace=True)
OmegaConf.register_new_resolver("hpcrl.controller", _controller_option, replace=True)
OmegaConf.register_new_resolver("hpcrl.lines", lambda lines: "\n".join(lines), replace=True)


def register_schema() -> None:
    """Register the root schema once; conf/config.yaml lists it first in its defaults."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def to_config(dcfg: DictConfig) -> Config:
    """Convert a composed config (with or without its ``hydra`` node) to a validated Config."""
    dcfg = dcfg.copy()
    with open_dict(dcfg):
        dcfg.pop("hydra", None)
    try:
        cfg = OmegaConf.to_object(dcfg)
    except MissingMandatoryValue as e:
        raise ConfigError(_key(e), "???", "a value: this field has no default, set it on the command line") from e
    except OmegaConfBaseException as e:
        raise ConfigError(_key(e), getattr(e, "value", None), str(e).splitlines()[0]) from e
    if not isinstance(cfg, Config):
        raise ConfigError("<root>", type(cfg).__name__, f"a config composed on {SCHEMA_NAME}")
    return validate(cfg)


def _key(e: OmegaConfBaseException) -> str:
    return str(getattr(e, "full_key", None) or "<config>")


def exit_on_config_error(e: ConfigError) -> NoReturn:
    """One line on stderr naming the bad field, and exit code 2."""
    print(f"hpcrl: config error: {e}", file=sys.stderr)
    sys.exit(2)


def compose_config(overrides: list[str], conf_dir: Path = CONF_DIR) -> Config:
    """The validated config ``python -m hpcrl.main OVERRIDES`` would run (shorthand expanded, keys checked);
    ``ConfigError`` for a bad one, Hydra's composition errors (an unknown group option) included."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from hpcrl.config.overrides import check_override_keys, expand_allocation_shorthand

    overrides = expand_allocation_shorthand(overrides)
    check_override_keys(overrides, conf_dir)
    register_schema()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return to_config(compose(config_name="config", overrides=overrides))
    except HydraException as e:
        cause = f": {e.__cause__}" if e.__cause__ else ""
        raise ConfigError("overrides", " ".join(overrides), f"a config Hydra can compose ({e}{cause})") from e


def to_config_or_exit(dcfg: DictConfig) -> Config:
    try:
        return to_config(dcfg)
    except ConfigError as e:
        exit_on_config_error(e)


class ValidateBeforeLaunch(Callback):
    """Fail a multirun before its launcher submits anything when the config is invalid.

    Hydra turns an exception raised in a callback into a warning and goes on, so this exits instead.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        to_config_or_exit(config)
