"""The Hydra edge: schema registration, DictConfig -> Config conversion, and the pre-launch check.

Below this module no code sees a DictConfig: ``to_config`` turns the composed config into plain
dataclasses once, validated. ``ValidateBeforeLaunch`` runs the same check on every job of a multirun (``-m``)
before its launcher starts or submits any, so a bad job fails before the first runs or any Slurm job is submitted.
"""

from __future__ import annotations

import contextlib
import math
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from hpcrl.config.checks import validate
from hpcrl.config.errors import ConfigError
from hpcrl.config.launcher import check_slurm_here
from hpcrl.config.schema import Config
from hpcrl.errors import UserError, exit_on_user_error

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


def exit_on_config_error(e: ConfigError, where: str = "") -> NoReturn:
    """One line on stderr naming the bad field (after ``where``: which job of a sweep), and exit code 2."""
    print(f"hpcrl: config error: {where}{e}", file=sys.stderr)
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
    """Check every job of a multirun before its launcher starts or submits any (``check_sweep``); with a submitit
    launcher, say where each job's run directory and logs will be, and print each job's summary at the end, or,
    for a dry run, print what would be submitted and submit nothing (``print_dry_run``).

    Hydra turns an exception raised in a callback into a warning and goes on, so this exits instead.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._check(config)
        except UserError as e:  # e.g. no Slurm here for the Slurm launcher: one line, exit 2
            exit_on_user_error(e)
        except Exception:  # Hydra would warn and launch the sweep unchecked (or submit a dry run): end here
            with contextlib.suppress(OSError):  # stdout or stderr closed (a pipe) is one such exception
                traceback.print_exc()
                print("hpcrl: the sweep's check failed (above); nothing was started or submitted", file=sys.stderr)
            sys.exit(1)

    def _check(self, config: DictConfig) -> None:
        jobs = check_sweep(config)
        if not _submitit(config):
            return  # the basic launcher's jobs run here, each a run (or a dry run) of its own
        if any(job.cfg.run.dry_run for job in jobs):
            print_dry_run(config, jobs)
            sys.exit(0)
        check_slurm_here(str(config.hydra.launcher.get("_target_", "")))
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


@dataclass(frozen=True)
class SweepJob:
    number: int  # Hydra's job number, hydra.job.num
    swept: list[str]  # its values of the swept keys, e.g. ["train.lr=0.0001"]
    cfg: Config  # its config, checked


def check_sweep(config: DictConfig) -> list[SweepJob]:
    """Every job of a multirun, each composed as its launcher will compose it and checked as ``hpcrl.main`` checks
    it (``launch_config``, and its run directory: ``resume.check_start``); the first bad one exits with its one
    line, naming the job when there are several. With a sweeper other than Hydra's basic one, whose jobs are known
    only as it runs, the sweep's own config is checked."""
    from hydra.core.global_hydra import GlobalHydra

    from hpcrl.config.resume import check_start
    from hpcrl.rundir import RunDir

    overrides = sweep_overrides(config)
    if overrides is None:
        return [SweepJob(0, [], launch_config_or_exit(config, list(config.hydra.overrides.task)))]
    loader = GlobalHydra.instance().config_loader()
    swept = [i for i, values in enumerate(zip(*overrides, strict=True)) if len(set(values)) > 1]
    jobs = []
    for number, job in enumerate(overrides):
        where = f"job {number} of the sweep ({' '.join(job[i] for i in swept)}): " if len(overrides) > 1 else ""
        try:
            cfg = launch_config(loader.load_sweep_config(config, list(job)), job)
            check_start(cfg, RunDir.at(cfg.run.root, cfg.run.experiment, cfg.run.trial, number))
        except ConfigError as e:
            exit_on_config_error(e, where)
        jobs.append(SweepJob(number, [job[i] for i in swept], cfg))
    return jobs


def sweep_overrides(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, in job-number order, as Hydra's basic sweeper makes them (``hydra.sweeper.params``,
    then the command line's, their product); None under another sweeper."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # its split is Hydra's only statement of it
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if config.hydra.sweeper.get("_target_") != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return None
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    arguments = parser.parse_overrides([*params, *config.hydra.overrides.task])
    return [job for batch in BasicSweeper.split_arguments(arguments, None) for job in batch]


def print_dry_run(config: DictConfig, jobs: list[SweepJob]) -> None:
    """What a submitit launcher would submit, on stdout as YAML documents: the launcher's settings (every job's),
    then each job's config; nothing is submitted (a dry run in the job would be a job all the same)."""
    from hpcrl.config.load import dump_config

    launcher = config.hydra.runtime.choices.get("hydra/launcher", "the launcher")
    if len({job.cfg.run.dry_run for job in jobs}) > 1:  # one job submitted and another not is no dry run
        exit_on_config_error(ConfigError("run.dry_run", "true,false", "the same for every job of a dry run"))
    print(f"# run.dry_run=true: nothing is submitted; {launcher} would submit {len(jobs)} job(s) with these settings")
    print(OmegaConf.to_yaml(config.hydra.launcher, resolve=True), end="")
    for job in jobs:
        run_dir = Path(job.cfg.run.root).expanduser().absolute() / job.cfg.run.experiment / job.cfg.run.trial
        print(f"--- # job {job.number} {' '.join(job.swept)}: in {run_dir / str(job.number)}")
        print(dump_config(job.cfg), end="")
    print(
        f"hpcrl: run.dry_run=true: the config of each of the {len(jobs)} job(s) is valid; nothing was submitted "
        f"(stdout: the settings of {launcher}, then each job's config)",
        file=sys.stderr,
        flush=True,
    )


SUMMARY_FILE = "summary.json"  # a run directory's summary line, which hpcrl.main also prints


def _submitit(config: DictConfig) -> bool:
    return "submitit" in str(config.hydra.launcher.get("_target_", ""))
