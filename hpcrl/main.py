"""``python -m hpcrl.main [group=option ...] [key=value ...]``: the hpcrl job.

Composes the config with Hydra (``hpcrl/conf``, and any ``--config-dir DIR`` after it), checks it before anything
starts (``hpcrl.config.hydra.launch_config``: every value, the keys given counting, the model directory and data
files there), makes the run
directory ``<run.root>/<run.experiment>/<run.trial>/`` (under ``-m``, ``.../<run.trial>/<job number>/`` for
each job of the sweep), refuses one where an earlier run left steps unless ``recover.mode=auto`` (or
the Slurm job was requeued) resumes it, runs the job (``hpcrl.controller.job``) and
ends with one JSON line on stdout, also written to ``<run dir>/summary.json``: steps, wall_s, eval_accuracy_before,
eval_accuracy_after, startup_s, run_dir, final_model (and resumed_from_step when ``recover.mode=auto``
resumed from a checkpoint). ``run.max_steps=0`` evaluates model.path instead, training nothing
(``hpcrl.controller.eval_only``: its summary has steps 0, eval_accuracy, eval_rows, evaluated_model, wall_s,
run_dir). With ``-m hydra/launcher=submitit_slurm`` the same function runs as a Slurm job; the
config is checked in the submitting process first, which says where the runs go and prints their summaries
at the end (``hpcrl.config.hydra.ValidateBeforeLaunch``); a failed job's last lines of stderr are printed after
submitit's report (``report_failed_job``).
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hpcrl.config import ConfigError, applies, format_spec
from hpcrl.config.hydra import CONF_DIR, SUMMARY_FILE, exit_on_config_error, launch_config_or_exit, register_schema
from hpcrl.config.load import dump_config
from hpcrl.config.overrides import (
    check_override_keys,
    config_dirs_in,
    expand_allocation_shorthand,
    imply_group_options,
    launcher_option,
)
from hpcrl.config.preflight import data_line, warn_tiny_task_settings
from hpcrl.config.resume import Resume, applied, check_start
from hpcrl.config.schema import Config
from hpcrl.controller.preempt import restarted_by_slurm
from hpcrl.errors import UserError, exit_on_user_error
from hpcrl.launch.process import end_within
from hpcrl.logs import setup_logging
from hpcrl.rundir import RunDir

log = logging.getLogger("hpcrl.main")
STOP_DEADLINE_S = 20.0  # after SIGTERM or SIGINT, the orderly shutdown's time; then everything is killed


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def run(dcfg: DictConfig) -> None:
    cfg = launch_config_or_exit(dcfg, list(HydraConfig.get().overrides.task))
    requeued = restarted_by_slurm()
    if requeued and cfg.recover.mode != "auto":  # a requeued job goes on from its last checkpoint
        cfg = replace(cfg, recover=replace(cfg.recover, mode="auto"))
    try:  # an earlier run there, and what a resume changes
        resume = check_start(cfg, RunDir.at(cfg.run.root, cfg.run.experiment, cfg.run.trial, sweep_job_number()))
    except ConfigError as e:
        exit_on_config_error(e)
    run_dir = RunDir.create(cfg.run.root, cfg.run.experiment, cfg.run.trial, sweep_job_number())
    setup_logging("controller", 0, cfg.run.log_level, run_dir.log_file("controller", 0))
    if resume is not None:
        cfg = applied(resume, cfg)
    written = write_run_config(cfg, run_dir, resume)
    warn_tiny_task_settings(cfg)
    applies.warn(cfg, launcher_option())  # once per run, on the console and in the controller's log
    log.info(
        "allocation %s on cluster %s (%s); run directory %s",
        format_spec(cfg.allocation.roles()),
        cfg.cluster.name,
        cfg.cluster.kind,
        run_dir.path,
    )
    if cfg.run.dry_run:
        print(dump_config(cfg), end="")
        log.info("%s", data_line(cfg))  # the split the run would load
        where = f"written to {written}" if written else f"not written: {run_dir.config_file} stays the run's config"
        log.info("run.dry_run=true: the config is valid and %s; nothing was started", where)
        return
    from hpcrl.controller.eval_only import run_eval_only
    from hpcrl.controller.job import run_job
    from hpcrl.controller.preempt import Preempted, PreemptionGuard

    if requeued:
        log.info("this Slurm job was requeued: it resumes from its last checkpoint (recover.mode=auto)")
    try:
        with PreemptionGuard() as guard:
            try:
                # run.max_steps=0: evaluation only, the servers and the reward, nothing trained
                summary = run_eval_only(cfg, run_dir) if cfg.run.max_steps == 0 else run_job(cfg, run_dir, guard)
            except Preempted as e:  # every worker is stopped by now; the checkpoint is complete
                log.warning("%s: requeueing the job, which resumes from there", e)
                guard.requeue()
                print(f"hpcrl: {e}; not requeued (not in a Slurm job): rerun with recover.mode=auto", file=sys.stderr)
                sys.exit(3)
    except KeyboardInterrupt:  # Ctrl-C: every worker is stopped by now
        log.warning("interrupted (Ctrl-C); every worker is stopped")
        overrides = list(HydraConfig.get().overrides.task)
        print(interrupted_message(run_dir, cfg.checkpoint.every_steps, overrides, sweep_job_number()), file=sys.stderr)
        sys.exit(130)
    except UserError as e:  # the user's input or environment (a data row, a model directory): one line, exit 2
        log.error("the run failed: %s", e)
        exit_on_user_error(e)
    except Exception as e:  # every worker is stopped by now; say why, then fail
        log.error("the run failed: %s", e, exc_info=True)
        print(f"hpcrl: the run failed ({type(e).__name__}): {e}", file=sys.stderr)
        sys.exit(1)
    (run_dir.path / SUMMARY_FILE).write_text(json.dumps(summary) + "\n")
    print(json.dumps(summary), flush=True)


def write_run_config(cfg: Config, run_dir: RunDir, resume: Resume | None) -> Path | None:
    """Write the config the run goes on with, and return where (None: nothing written). A new run's is
    ``config.yaml``; a resume that changes settings writes ``config.resumed-N.yaml`` beside the run's, headed by the
    changes, and says them in one line (the run's own config stays as it is: a dry run writes nothing)."""
    if resume is None:
        return run_dir.write_first_config(dump_config(cfg))
    if not resume.changes:
        log.info("resuming the run in %s with its settings (%s)", run_dir.path, run_dir.config_file.name)
        return None
    changes = "; ".join(map(str, resume.changes))
    if cfg.run.dry_run:
        log.warning("resuming the run in %s would change these settings: %s", run_dir.path, changes)
        return None
    was = run_dir.config_file
    path = run_dir.add_resumed_config(resume.header(was) + dump_config(cfg))
    log.warning("resuming the run in %s with changed settings (%s, beside %s): %s", run_dir.path, path.name,
                was.name, changes)  # fmt: skip
    return path


def interrupted_message(run_dir: RunDir, every_steps: int, overrides: list[str], sweep_job: int | None) -> str:
    """What an interrupted run tells its user: that it was interrupted, and the command that resumes it (the same
    overrides, with ``recover.mode=auto``), from its newest checkpoint if it wrote any. A sweep's job (Hydra gives
    it its own values, not the sweep's) is resumed by running the sweep again with ``recover.mode=auto``."""
    head = f"hpcrl: the run in {run_dir.path} was interrupted (Ctrl-C) and every worker is stopped"
    where = (
        f"from its newest checkpoint in {run_dir.checkpoints}"
        if every_steps
        else "(it wrote no checkpoint, checkpoint.every_steps=0: it starts again at step 1)"
    )
    if sweep_job is not None:
        return f"{head}; resume it {where} by running the sweep (-m) again with recover.mode=auto"
    kept = [o for o in overrides if not o.lstrip("+~").startswith("recover.mode=")]
    command = shlex.join(["python", "-m", "hpcrl.main", *kept, "recover.mode=auto"])
    return f"{head}; resume it {where} with:\n    {command}"


def sweep_job_number() -> int | None:
    """This job's number in a ``-m`` sweep (Hydra's ``hydra.job.num``), None outside one."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return int(HydraConfig.get().job.num)


def main() -> None:
    end_within(STOP_DEADLINE_S)  # a signalled run ends within this, whatever it is doing (launch/process.py)
    register_schema()
    sys.argv = imply_group_options(expand_allocation_shorthand(sys.argv))
    try:
        check_override_keys(sys.argv[1:], CONF_DIR, config_dirs_in(sys.argv[1:]))
    except ConfigError as e:
        exit_on_config_error(e)
    try:
        run()
    except SystemExit as e:  # Hydra reports an error, then exits: the error it reported is the exit's context
        report_failed_job(e.__context__)
        raise


FAILED_JOB_LINES = 20  # the last lines of a failed job's stderr printed where it was submitted


def report_failed_job(error: BaseException | None, lines: int = FAILED_JOB_LINES) -> None:
    """A controller job that failed under a submitit launcher reaches the submitting process as submitit's
    ``UncompletedJobError`` (or ``FailedJobError``), whose report holds the job's whole stderr, with the job's own
    error somewhere inside: print that stderr's last lines (without submitit's and srun's own lines) and where it is."""
    if error is None or type(error).__name__ not in ("UncompletedJobError", "FailedJobError"):
        return
    text = str(error)
    found = re.search(r"(\S+)_(?:result\.pkl|log\.err|log\.out)", text)
    if found is None:
        return
    stderr = Path(found.group(1) + "_log.err")
    state = re.search(r"\(state: (\w+)\)", text)
    tail = [
        line
        for line in (stderr.read_text(errors="replace").splitlines() if stderr.is_file() else [])
        if line.strip() and not line.startswith(("submitit ", "srun: "))
    ][-lines:]
    print(
        f"hpcrl: the controller job failed{f' ({state.group(1)})' if state else ''}; the last lines of its "
        f"stderr, {stderr}:",
        file=sys.stderr,
    )
    print("\n".join(f"    {line}" for line in tail) or "    (empty)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
