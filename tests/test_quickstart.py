"""End to end, the quickstart's path on smaller settings: the sample corpus, a 3-scale x 2-arm sweep
through the local executor, compare, a report with each arm's loss per scale (the runs' own) and plots."""

import json

import pytest
import yaml

from tests.conftest import REPO, nlq


@pytest.mark.slow
def test_quickstart_path_end_to_end(tmp_path):
    smoke = yaml.safe_load((REPO / "configs" / "sweeps" / "smoke.yaml").read_text())
    smoke["horizon"] = {"tokens": 12 * 8 * 64}  # 12 steps instead of 80
    smoke["seeds"] = smoke["seeds"][:1]  # CI time: the second seed runs the same path again
    smoke["overrides"] |= {"train.eval_every": 6, "checkpoint.every": 6, "logging.wandb": False}
    sweep = tmp_path / "smoke-small.yaml"
    sweep.write_text(yaml.safe_dump(smoke))
    root = tmp_path / "qs"

    r = nlq("quickstart", "--root", str(root), "--sweep", str(sweep), timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report_dir = root / "smoke" / "report"
    assert str(report_dir / "report.md") in r.stdout
    report = (report_dir / "report.md").read_text()
    summary = json.loads((report_dir / "summary.json").read_text())
    assert sorted(p.name for p in report_dir.glob("*.png"))  # the plots exist
    cells = {(c["scale"], c["arm"]): c for c in summary["cells"]}
    assert set(cells) == {(s, a) for s in smoke["scales"] for a in smoke["arms"]}
    for (scale, arm), cell in cells.items():  # one row per arm and scale, with its loss
        assert cell["n_seeds"] == 1 and 0 < cell["mean"] < 10, cell
        assert f"| {scale} | {arm} | {cell['best_lr']:.4g} | 1 | {cell['mean']:.4f} |" in report, (scale, arm)

    status = nlq("status", str(root / "smoke"), "--json")
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)["runs"]
    assert [row["state"] for row in rows] == ["completed"] * 6
    # the report's losses are the runs' final validation losses
    assert sorted(c["mean"] for c in cells.values()) == pytest.approx(sorted(row["val_loss"] for row in rows), rel=1e-9)

    again = nlq("quickstart", "--root", str(root), "--sweep", str(sweep), timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already prepared" in again.stdout and "running" not in again.stdout  # nothing re-run
