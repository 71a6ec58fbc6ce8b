"""hpcrl installs as a package: the wheel holds every config group (``hpcrl/conf``, the one copy, which nothing at
the top of the repository links to: a site file written there by following the docs would land in the package),
and ``python -m hpcrl.main`` run from another directory finds them in the installed package, not in a checkout."""

import os
import subprocess
import sys
import zipfile

import pytest
import yaml

from tests.conftest import CONF_DIR, REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300, cwd=out)
    (built,) = out.glob("hpcrl-*.whl")
    return built


def test_nothing_at_the_top_of_the_repository_leads_into_the_package_configs():
    leads_in = [p.name for p in REPO.iterdir() if p.resolve().is_relative_to(CONF_DIR.resolve())]
    assert leads_in == [], "a user's site file must not land in hpcrl/conf (docs/slurm.md: --config-dir DIR)"


def test_the_wheel_holds_every_config_group_as_it_is_in_the_tree(wheel):
    with zipfile.ZipFile(wheel) as z:
        shipped = {name: z.read(name) for name in z.namelist() if name.startswith("hpcrl/conf/")}
    expected = {f"hpcrl/conf/{p.relative_to(CONF_DIR)}": p.read_bytes() for p in CONF_DIR.rglob("*.yaml")}
    assert shipped == expected
    assert "hpcrl/conf/config.yaml" in shipped and "hpcrl/conf/cluster/slurm.yaml" in shipped


def test_the_installed_package_runs_from_another_directory(wheel, tmp_path):
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, text=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the installed copy comes first on the path (the checkout's editable install is found after it)
    env = {**os.environ, "PYTHONPATH": str(target), "HYDRA_FULL_ERROR": "0"}
    where = subprocess.run(
        [sys.executable, "-c", "import hpcrl; print(hpcrl.__file__)"], cwd=elsewhere, env=env, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    assert where.stdout.strip() == str(target / "hpcrl" / "__init__.py")
    args = ["experiment=gsm8k", "dataset.train_files=[t.jsonl]", "run.dry_run=true", f"run.root={tmp_path / 'runs'}"]
    args += ["dataset.eval_files=[t.jsonl]", "rollout.max_new_tokens=64"]  # the preflight: the tiny model's context
    (elsewhere / "t.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    result = subprocess.run(
        [sys.executable, "-m", "hpcrl.main", *args], cwd=elsewhere, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["reward"]["fn"] == "hpcrl.reward.builtin:math_verify_reward"
    misspelled = subprocess.run(
        [sys.executable, "-m", "hpcrl.main", "experiment=gsm8"], cwd=elsewhere, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert misspelled.returncode == 2 and "did you mean 'gsm8k'?" in misspelled.stderr
