"""GPU checks: nvidia-smi, torch's CUDA devices and SGLang, where the run's GPU workers would run.

SGLang must import, be a release of the tested range (``inference/sglang_api.py``) and serve every endpoint
hpcrl calls (``doctor/sglang.py``).

    cluster.gpus_per_node == 0 or no role asks for GPUs   one ``skip`` line: nothing to check, and on a CPU
                                                          machine nothing of it could run
    cluster.kind=local                                    ``python -m hpcrl.doctor.probe gpu`` here (with a deadline)
    cluster.kind=slurm                                    the same, as a job with one GPU (nodes.py)

The probe's ``HPCRL-PROBE {json}`` line becomes one result per part (``gpu_results``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

from hpcrl.config.schema import Config
from hpcrl.doctor.probe import GPU_PARTS, MARKER
from hpcrl.doctor.report import Result, fail, ok, skip

ADVICE = {
    "nvidia-smi": "no working NVIDIA driver where the GPU workers run: check that cluster.partition (or the role's) "
    "is a GPU partition and cluster.extra_sbatch its GPU options, or ask the site",
    "torch": "install a CUDA build of torch where the jobs run (pip install -e '.[sglang]' brings one); "
    "load CUDA in cluster.setup if the site needs it",
    "sglang": "install the tested release where the jobs run: pip install -e '.[sglang]' (cluster.setup may "
    "activate that environment)",
}


def gpu_role(cfg: Config) -> str | None:
    """The first role that asks for GPUs (its nodes are where the GPU probe runs); None when none does."""
    roles = cfg.allocation.roles()
    return next((role for role, a in roles.items() if a.gpus_per_worker), None)


def not_applicable(cfg: Config) -> Result | None:
    """The ``skip`` line when there is nothing to check; None when the GPU checks apply."""
    if cfg.cluster.gpus_per_node == 0:
        return skip(
            "gpu",
            f"cluster.gpus_per_node=0 ({cfg.cluster.name} is a CPU cluster): nvidia-smi, torch CUDA and "
            "import sglang are not checked, and cannot run on CPU nodes",
        )
    if gpu_role(cfg) is None:
        return skip("gpu", "no role of the allocation asks for GPUs: nvidia-smi, torch CUDA and sglang are not needed")
    return None


def gpu_checks_here(cfg: Config, python: str, timeout_s: float) -> Iterator[Result]:
    """cluster.kind=local with GPUs: the probe as a subprocess of this machine."""
    try:
        result = subprocess.run(
            [python, "-m", "hpcrl.doctor.probe", "gpu"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        yield fail("gpu", f"the GPU probe did not answer within {timeout_s:g} s", "run nvidia-smi here and look")
        return
    report = read_report(result.stdout)
    if report is None:
        tail = (result.stderr.strip() or "<no output>").splitlines()[-5:]
        yield fail("gpu", f"the GPU probe failed: {' | '.join(tail)}", "run python -m hpcrl.doctor.probe gpu here")
        return
    yield from gpu_results(report, cfg, "this machine")


def read_report(text: str) -> dict[str, Any] | None:
    """The probe's report from its output (the last ``HPCRL-PROBE`` line); None when there is none."""
    lines = [line for line in text.splitlines() if line.startswith(MARKER)]
    return json.loads(lines[-1].removeprefix(MARKER)) if lines else None


def gpu_results(report: dict[str, Any], cfg: Config, where: str) -> Iterator[Result]:
    needs_sglang = any(a.backend == "sglang" for a in cfg.allocation.roles().values())
    for part in GPU_PARTS:
        item = report.get(part) or {"ok": False, "detail": "missing from the probe's report"}
        found = f"on {where}: {item['detail']}"
        if part == "sglang" and not needs_sglang:
            yield skip(f"gpu {part}", f"not needed: no server uses backend sglang ({found})")
        elif item["ok"]:
            yield ok(f"gpu {part}", found)
        else:
            yield fail(f"gpu {part}", found, item.get("advice") or ADVICE[part])
