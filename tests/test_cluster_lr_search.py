"""A sweep's two-phase learning-rate search (`lr_search: {strategy: proxy, width: W}`, cluster/lr_search.py):
the LR grid on a narrow muP proxy, then every seed at the fitted optimum under muP with the proxy's
width as base, and one seed a grid step either side."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from nlq_scale.cluster.lr_search import due_runs
from nlq_scale.cluster.sweep import expand, load_sweep
from nlq_scale.errors import UsageError
from nlq_scale.train.rundir import read_config, read_metrics, write_metrics, write_status
from tests.conftest import nlq

LRS = [0.001, 0.01, 1.0]
SHORT = {"train.steps": 4, "train.warmup_steps": 1, "train.eval_every": 4, "checkpoint.every": 4,
         "logging.wandb": False}  # fmt: skip


def lr_search_sweep(tmp_path: Path, data: Path | str, lrs=LRS, seeds=(1234,), cluster: str = "local") -> Path:
    path = tmp_path / "lrs.yaml"
    path.write_text(yaml.safe_dump({
        "name": "lrs", "cluster": cluster, "scales": ["cpu-xs"], "arms": ["nonlinear"], "seeds": list(seeds),
        "lrs": lrs, "lr_search": {"strategy": "proxy", "width": 32}, "data": {"path": str(data)}, "overrides": SHORT,
    }))  # fmt: skip
    return path


def vertex(lrs: list[float], losses: list[float]) -> float:
    a, b, _ = np.polyfit(np.log(lrs), losses, 2)
    return math.exp(-b / (2 * a))


def _finish(run_dir: Path, state: str, loss: float | None = None) -> None:
    run_dir.mkdir(parents=True)
    write_status(run_dir, {"state": state, "step": 4})
    write_metrics(run_dir, [{"step": 4, "val/loss": loss}] if loss is not None else [])


def test_targets_wait_for_every_proxy_and_an_interior_optimum(tmp_path):
    sweep = load_sweep(lr_search_sweep(tmp_path, "/data", seeds=(1, 2)))
    grid, root = expand(sweep), tmp_path / "runs"
    specs, waiting = due_runs(sweep, grid, root)
    assert [s.run_id for s in specs] == [f"cpu-xs-nonlinear-s1-lr{lr:g}-proxy32" for lr in LRS]
    proxy = specs[0].cfg.model
    assert (proxy.hidden_size, proxy.num_attention_heads, proxy.parametrization, proxy.mup_base_hidden_size) == (
        32, 1, "mup", 32)
    assert specs[0].cfg.variant == "nonlinear-proxy32"
    assert waiting == ["cpu-xs/nonlinear: 0 of 3 proxy runs ended (completed or diverged)"]

    for spec, loss in zip(specs, (9.0, 7.0, 8.0)):
        _finish(spec.run_dir(root), "completed", loss)
    specs, waiting = due_runs(sweep, grid, root)
    eta = vertex(LRS, [9.0, 7.0, 8.0])
    step = math.sqrt(1000)
    targets = specs[3:]
    assert waiting == [] and [t.seed for t in targets] == [1, 2, 1, 1]
    assert [t.lr for t in targets] == pytest.approx([eta, eta, eta / step, eta * step], rel=1e-12)
    model = targets[0].cfg.model
    assert (model.hidden_size, model.parametrization, model.mup_base_hidden_size) == (64, "mup", 32)
    assert targets[0].run_id == f"cpu-xs-nonlinear-s1-lr{targets[0].lr:g}"

    # The best of those that did not diverge is on the grid's edge: nothing is submitted, the line says why.
    for spec, (state, loss) in zip(specs[:3], (("completed", 9.0), ("completed", 7.0), ("diverged", None))):
        spec.run_dir(root).joinpath("status.json").unlink()
        write_status(spec.run_dir(root), {"state": state, "step": 4})
    specs, waiting = due_runs(sweep, grid, root)
    assert len(specs) == 3 and waiting == [
        "cpu-xs/nonlinear: the proxies' best LR 0.01 is on the edge of the 2 that did not diverge: extend lrs"]


def test_a_proxy_search_needs_a_grid_and_a_width(tmp_path):
    sweep = load_sweep(lr_search_sweep(tmp_path, "/data", lrs=[0.001, 0.01]))
    with pytest.raises(UsageError, match="has 2 learning rate"):
        due_runs(sweep, expand(sweep), tmp_path)
    bad = lr_search_sweep(tmp_path, "/data")
    bad.write_text(bad.read_text().replace("width: 32", "width: null"))
    r = nlq("submit", str(bad), "--dry-run")
    assert r.returncode == 2 and "lr_search" in r.stderr and "strategy proxy needs a width" in r.stderr


@pytest.mark.slow
def test_local_submit_runs_the_proxies_then_the_targets_at_their_optimum(tmp_path, sample_dataset):
    root = tmp_path / "runs"
    r = nlq("submit", str(lr_search_sweep(tmp_path, sample_dataset)), "--executor", "local", "--root", str(root))
    assert r.returncode == 0, r.stderr[-3000:]
    check_targets(root / "lrs", target_dirs(root / "lrs"))


def target_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.name.startswith("cpu-xs") and "proxy" not in p.name)


def check_targets(sweep_dir: Path, targets: list[Path]) -> None:
    """The targets run under muP (base 32) at eta* of the proxies' final val losses, and a grid step either side."""
    finals = [[r for r in read_metrics(sweep_dir / f"cpu-xs-nonlinear-s1234-lr{lr:g}-proxy32") if "val/loss" in r][-1]
              ["val/loss"] for lr in LRS]  # fmt: skip
    lrs = sorted(read_config(p).train.lr for p in targets)
    eta = vertex(LRS, finals)
    assert lrs == pytest.approx([eta / math.sqrt(1000), eta, eta * math.sqrt(1000)], rel=1e-12), (finals, lrs)
    assert all(read_config(p).model.mup_base_hidden_size == 32 for p in targets)


def test_plan_prices_a_proxy_sweep_at_its_own_width(tmp_path):
    r = nlq("plan", str(lr_search_sweep(tmp_path, "/data")), "--json")
    assert r.returncode == 0, r.stderr
    cost = json.loads(r.stdout)["lr_proxy"]
    assert cost["width"] == 32 and 0 < cost["proxy_gpu_hours"] < cost["grid_gpu_hours"]
