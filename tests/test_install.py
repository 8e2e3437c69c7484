"""The package as users install it: a built wheel (not the checkout), run from an unrelated directory,
finds its shipped scales, arms, sweeps, clusters and sbatch templates; a user's own config directory
adds to them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp / "dist").glob("nlq_scale-*.whl")
    target = tmp / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return target


def run_installed(site: Path, cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nlq_scale.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
        env=os.environ | {"PYTHONPATH": str(site)} | (env or {}),
    )  # fmt: skip


def test_wheel_runs_params_and_plan_from_an_unrelated_directory(installed, tmp_path):
    where = run_installed(installed, tmp_path, "config", "path", "configs")
    assert where.returncode == 0 and Path(where.stdout.strip()).is_relative_to(installed), where.stdout + where.stderr
    params = run_installed(installed, tmp_path, "params", "--scale", "124m", "--arm", "nonlinear", "--json")
    assert params.returncode == 0, params.stderr
    assert json.loads(params.stdout)["arm"] == "nonlinear"
    plan = run_installed(installed, tmp_path, "plan", "ladder", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["sweep"] == "ladder"
    slurm = Path(run_installed(installed, tmp_path, "config", "path", "slurm").stdout.strip())
    assert {"train.sbatch", "array.sbatch", "run-train.sh"} <= {p.name for p in slurm.iterdir()}


def test_a_users_config_dir_adds_scales(installed, tmp_path):
    mine = tmp_path / "mine"
    (mine / "scales").mkdir(parents=True)
    (mine / "scales" / "my-50m.yaml").write_text("model: {num_layers: 6, hidden_size: 512, num_attention_heads: 8}\n")
    by_flag = run_installed(installed, tmp_path, "--config-dir", str(mine), "params", "--scale", "my-50m", "--arm",
                            "linear", "--json")  # fmt: skip
    assert by_flag.returncode == 0, by_flag.stderr
    assert json.loads(by_flag.stdout)["layers"] == 6
    by_env = run_installed(installed, tmp_path, "params", "--scale", "my-50m", "--arm", "linear", "--json",
                           env={"NLQ_SCALE_CONFIG_PATH": str(mine)})  # fmt: skip
    assert by_env.returncode == 0, by_env.stderr
    unknown = run_installed(installed, tmp_path, "params", "--scale", "my-50m", "--arm", "linear")
    assert unknown.returncode == 2 and "unknown scale 'my-50m'" in unknown.stderr
