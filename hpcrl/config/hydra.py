"""The Hydra edge: schema registration, DictConfig -> Config conversion, and the pre-launch check.

Below this module no code sees a DictConfig: ``to_config`` turns the composed config into plain
dataclasses once, validated. ``ValidateBeforeLaunch`` runs the same check in the submitting process
of a multirun (``-m``), so a bad config fails before any Slurm job is submitted.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
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
    """Register the root schema once; conf/config.yaml lists it first in its defaults. The controller job's
    launcher option (``hydra/launcher=submitit_slurm``) too: ``hpcrl.config.launcher``."""
    from hpcrl.config.launcher import register_launcher

    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)
    register_launcher()


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


def compose_config(overrides: list[str], conf_dir: Path = CONF_DIR, config_dirs: Sequence[Path] = ()) -> Config:
    """The config ``python -m hpcrl.main [--config-dir DIR ...] OVERRIDES`` would run, checked as it checks it
    (shorthand expanded, ``model.path`` implying ``model=local``, keys and group options, every value, the keys
    given counting, the model directory and data files there); ``ConfigError`` for a bad one, Hydra's
    composition errors included. ``config_dirs`` are searched after ``conf_dir``, as ``--config-dir`` is."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from hpcrl.config.overrides import check_override_keys, expand_allocation_shorthand, imply_group_options

    overrides = imply_group_options(expand_allocation_shorthand(overrides))
    check_override_keys(overrides, conf_dir, config_dirs)
    register_schema()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            dcfg = compose(config_name="config", overrides=with_searchpath(overrides, config_dirs))
    except HydraException as e:
        cause = f": {e.__cause__}" if e.__cause__ else ""
        raise ConfigError("overrides", " ".join(overrides), f"a config Hydra can compose ({e}{cause})") from e
    return launch_config(dcfg, overrides)


def with_searchpath(overrides: list[str], dirs: Sequence[Path]) -> list[str]:
    """``overrides`` with ``dirs`` added to ``hydra.searchpath`` (after any entries given there)."""
    if not dirs:
        return overrides
    from hydra.core.override_parser.overrides_parser import OverridesParser

    entries, rest = [], []
    for line in overrides:
        if line.partition("=")[0] == "hydra.searchpath":
            (override,) = OverridesParser.create().parse_overrides([line])
            entries += [str(v) for v in override.value()]
        else:
            rest.append(line)
    entries += [f"file://{d}" for d in dirs]
    return [*rest, f"hydra.searchpath=[{','.join(entries)}]"]


def launch_config(dcfg: DictConfig, overrides: Sequence[str]) -> Config:
    """The checks before a launch: ``to_config``, then the keys given that the config would ignore
    (``overrides.check_given_keys_count``), then what it names outside itself (``preflight``)."""
    from hpcrl.config.overrides import check_given_keys_count
    from hpcrl.config.preflight import preflight

    cfg = to_config(dcfg)
    check_given_keys_count(overrides, cfg)
    preflight(cfg)
    return cfg


def to_config_or_exit(dcfg: DictConfig) -> Config:
    try:
        return to_config(dcfg)
    except ConfigError as e:
        exit_on_config_error(e)


def launch_config_or_exit(dcfg: DictConfig, overrides: Sequence[str]) -> Config:
    try:
        return launch_config(dcfg, overrides)
    except ConfigError as e:
        exit_on_config_error(e)


class ValidateBeforeLaunch(Callback):
    """Fail a multirun before its launcher submits anything when the config is invalid; with a submitit
    launcher, say where each job's run directory and logs will be, and print each job's summary at the end.

    Hydra turns an exception raised in a callback into a warning and goes on, so this exits instead.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launch_config_or_exit(config, list(config.hydra.overrides.task))
        if _submitit(config):
            sweep = Path(str(config.hydra.sweep.dir)).absolute()
            print(
                f"hpcrl: each job of this sweep runs in {sweep}/<job number>/ (0 for a single job); follow it in "
                f"{sweep}/<job number>/logs/controller-0.log; the jobs' own output: {sweep}/.submitit/<job id>/",
                file=sys.stderr,
                flush=True,
            )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not _submitit(config):
            return  # the basic launcher's jobs print their summary themselves
        sweep = Path(str(config.hydra.sweep.dir)).absolute()
        for summary in sorted(sweep.glob(f"*/{SUMMARY_FILE}"), key=lambda p: int(p.parent.name)):
            print(summary.read_text().strip(), flush=True)


SUMMARY_FILE = "summary.json"  # a run directory's summary line, which hpcrl.main also prints


def _submitit(config: DictConfig) -> bool:
    return "submitit" in str(config.hydra.launcher.get("_target_", ""))
