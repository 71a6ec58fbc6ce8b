"""The doctor's SGLang check, against fake installs (package metadata and a route file in a directory).

Inside a GPU job the probe runs ``sglang_status()`` on the SGLang that job's Python has; no GPU and no SGLang
install can be had here, so its logic is tested on directories laid out as an install is (a
``sglang-<version>.dist-info`` and ``sglang/srt/entrypoints/http_server.py``), and once on the files of the
real 0.5.23 wheel. Where the release cannot be installed at all (``install_problems``), the platform values
are given as arguments.
"""

import platform
import sys
import tomllib
import zipfile

import pytest

from hpcrl.doctor.gpu import gpu_results
from hpcrl.doctor.sglang import install_problems, install_status, sglang_status
from hpcrl.inference.sglang_api import CALLED, HTTP_SERVER, SGLANG_REQUIREMENT, TESTED
from tests.conftest import REPO
from tests.inference.sglang_wheel import fetch_wheel


def route_file(endpoints=CALLED) -> str:
    """An http_server.py declaring ``endpoints`` the ways SGLang does (get/post/api_route)."""
    lines = ["from fastapi import FastAPI", "app = FastAPI()"]
    for i, (method, path) in enumerate(endpoints):
        decorator = f'@app.{method.lower()}("{path}")'
        if path == "/flush_cache":
            decorator = f'@app.api_route("{path}", methods=["GET", "POST"])'
        lines += [decorator, f"async def route_{i}():", "    return None"]
    return "\n".join(lines) + "\n"


def install(root, version: str, routes: str | None = None):
    """A fake install of sglang ``version`` under ``root``; returns the search path for it."""
    info = root / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    server = root / HTTP_SERVER
    server.parent.mkdir(parents=True)
    server.write_text(route_file() if routes is None else routes)
    return [str(root)]


@pytest.mark.parametrize("version", [TESTED, f"{TESTED}.post1", f"{TESTED}.1"])
def test_the_tested_release_and_its_patch_releases_pass(tmp_path, version):
    status = sglang_status(install(tmp_path, version))
    assert status["ok"], status
    assert version in status["detail"] and "every endpoint" in status["detail"]


@pytest.mark.parametrize("version", ["0.5.1", "0.5.22", "0.5.24", "0.6.0"])
def test_other_releases_fail_naming_the_range(tmp_path, version):
    status = sglang_status(install(tmp_path, version))
    assert not status["ok"]
    assert f"sglang {version} is not in the range hpcrl is tested with" in status["detail"]
    assert SGLANG_REQUIREMENT in status["detail"], "the failure says what to install"


def test_a_missing_or_changed_endpoint_fails_naming_it(tmp_path):
    without_begin = [e for e in CALLED if e[1] != "/begin_weight_update"]
    status = sglang_status(install(tmp_path / "a", TESTED, route_file(without_begin)))
    assert not status["ok"] and "does not serve POST /begin_weight_update, which hpcrl calls" in status["detail"]
    without_classify = [e for e in CALLED if e[1] != "/classify"]
    status = sglang_status(install(tmp_path / "c", TESTED, route_file(without_classify)))
    assert not status["ok"] and "does not serve POST /classify" in status["detail"], "the reward model's client's"
    as_get = [("GET", p) if p == "/end_weight_update" else (m, p) for m, p in CALLED]
    status = sglang_status(install(tmp_path / "b", TESTED, route_file(as_get)))
    assert not status["ok"] and "POST /end_weight_update" in status["detail"]


def test_no_install_fails(tmp_path):
    status = sglang_status([str(tmp_path)])
    assert status == {"ok": False, "detail": "sglang is not installed (no package metadata)"}


def test_the_real_wheel_passes(tmp_path):
    """The route file of the wheel the contract test reads: every endpoint hpcrl calls is there."""
    with zipfile.ZipFile(fetch_wheel()) as wheel:
        routes = wheel.read(HTTP_SERVER).decode()
    status = sglang_status(install(tmp_path, TESTED, routes))
    assert status["ok"], status


def test_the_extra_pins_the_range_the_check_checks():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [SGLANG_REQUIREMENT]


def test_a_failing_sglang_check_is_a_failed_doctor_line_with_advice(tmp_path):
    from tests.config.compose import load

    cfg = load("cluster=slurm", "allocation.spec=sglang:d1+fsdp:d1")
    report = {
        "nvidia-smi": {"ok": True, "detail": "GPU 0"},
        "torch": {"ok": True, "detail": "1 devices"},
        "sglang": sglang_status(install(tmp_path, "0.5.1")),
    }
    results = {r.check: r for r in gpu_results(report, cfg, "node1")}
    sglang = results["gpu sglang"]
    assert sglang.status == "fail" and "0.5.1 is not in the range" in sglang.found
    assert "pip install -e '.[sglang]'" in sglang.advice


@pytest.mark.parametrize(
    ("python", "machine", "libc"),
    [((3, 11, 7), "x86_64", ("glibc", "2.34")), ((3, 12), "aarch64", ("glibc", "2.39"))],
)
def test_where_the_tested_release_installs_nothing_is_missing(python, machine, libc):
    assert install_problems(python, machine, libc) == []
    assert install_status([]) is None


@pytest.mark.parametrize(
    ("python", "machine", "libc", "problem"),
    [
        ((3, 13), "x86_64", ("glibc", "2.39"), "Python 3.13 (needs 3.11 or 3.12)"),
        ((3, 10), "x86_64", ("glibc", "2.39"), "Python 3.10 (needs 3.11 or 3.12)"),
        ((3, 11), "ppc64le", ("glibc", "2.39"), "ppc64le (needs x86_64 or aarch64)"),
        ((3, 11), "x86_64", ("glibc", "2.28"), "glibc 2.28 (needs >= 2.34)"),  # RHEL/Rocky 8
        ((3, 11), "x86_64", ("glibc", "2.4"), "glibc 2.4 (needs >= 2.34)"),  # compared as numbers, not text
        ((3, 11), "x86_64", ("", ""), "no glibc (needs glibc >= 2.34)"),  # musl (Alpine), macOS
    ],
)
def test_each_platform_problem_is_named(python, machine, libc, problem):
    assert install_problems(python, machine, libc) == [problem]


def test_install_problems_default_to_this_machine():
    here = install_problems(sys.version_info, platform.machine(), platform.libc_ver())
    assert install_problems() == here


def test_a_node_where_sglang_cannot_install_is_one_doctor_line_naming_all_of_it():
    from tests.config.compose import load

    cfg = load("cluster=slurm", "allocation.spec=sglang:d1+fsdp:d1")
    problems = install_problems((3, 13, 1), "ppc64le", ("glibc", "2.28"))
    report = {"nvidia-smi": {"ok": True, "detail": "GPU 0"}, "torch": {"ok": True, "detail": "1 devices"}}
    report["sglang"] = install_status(problems)
    line = {r.check: r for r in gpu_results(report, cfg, "node1")}["gpu sglang"].line()
    assert line == (
        f"fail  gpu sglang: on node1: sglang {TESTED} cannot be installed here: Python 3.13 (needs 3.11 or 3.12), "
        "ppc64le (needs x86_64 or aarch64), glibc 2.28 (needs >= 2.34); "
        f"sglang {TESTED} publishes only wheels, for CPython 3.11/3.12 on Linux x86_64/aarch64 with glibc >= 2.34: "
        "run the servers on such nodes, or in a container image that has them"
    )
