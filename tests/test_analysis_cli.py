"""`nlq-scale compare` and `nlq-scale fit` end to end: report.md, PNGs and summary.json from run
directories, the --json document, W&B logging of the report, and one-line errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nlq_scale.analysis.compare import Options, compare
from nlq_scale.analysis.report import log_to_wandb, write_report
from nlq_scale.analysis.runs import load_runs
from nlq_scale.cli import main
from nlq_scale.errors import UsageError
from tests.analysis_rundirs import EVAL_EVERY, STEPS, curve, make_config, make_sweep, power_law_truth, write_run_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    truth = power_law_truth(E=2.0, A=30.0, alpha=0.12, multipliers={"nonlinear": 1.5, "identity": 0.8})
    make_sweep(root, truth, ["linear", "nonlinear", "identity"], ["t1", "t2", "t3"], seeds=[0, 1], lrs=[1e-3, 2e-3])
    steps = np.arange(EVAL_EVERY, STEPS + 1, EVAL_EVERY)
    blowup = curve(3.1, steps, STEPS)
    blowup[5:] += np.linspace(1.0, 5.0, len(steps) - 5)
    write_run_dir(root, make_config("nonlinear", "t2", 9, 1e-3), steps, blowup)
    write_run_dir(root, make_config("linear", "t3", 9, 1e-3), steps[:4], curve(3.1, steps, STEPS)[:4], state="running")
    return root


def test_compare_writes_report_plots_and_summary(sweep, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["compare", str(sweep), "--out", str(out), "--bootstrap", "300"]) == 0
    printed = capsys.readouterr().out
    assert f"report:  {out / 'report.md'}" in printed
    for stem in ("loss_vs_step", "loss_vs_compute", "relative_improvement"):
        png = out / f"{stem}.png"
        assert str(png) in printed
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000
    report = (out / "report.md").read_text()
    assert "300 resamples" in report and "Reference arm: **linear**" in report
    assert "3 points for 3 parameters" in report  # three scales: exact interpolation is said out loud
    assert "## Learning-rate grid" in report and "![relative_improvement](relative_improvement.png)" in report
    assert "| nonlinear-t2-s9-lr0.001 | nonlinear | t2 | 9 | 0.001 | completed | diverged (blow-up at step 120) |" in report
    assert "state running (--include-incomplete to use it)" in report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bootstrap"]["resamples"] == 300 and summary["reference"] == "linear"
    assert {c["arm"] for c in summary["cells"]} == {"linear", "nonlinear", "identity"}
    by_arm = {m["arm"]: m for m in summary["multipliers"] if m["scale"] == "t2"}
    assert by_arm["nonlinear"]["value"] > 1 > by_arm["identity"]["value"]
    assert by_arm["nonlinear"]["separated"] and 0 < by_arm["nonlinear"]["resamples"] <= 300
    for fit in summary["fits"]:  # an asymptote the seeds' noise moves onto 0 is flagged, never silent
        assert fit["identifiable"] == (not fit["flags"]) and fit["objective"] >= 0
        if fit["E"]["ci"][0] < 0:
            assert "reaches its bound 0" in fit["statement"] and fit["statement"] in report
    assert not list(out.glob(".*.tmp"))  # no temporary leftovers


def test_compare_json_and_reference_choice(sweep, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["compare", str(sweep), "--out", str(out), "--json", "--bootstrap", "200",
                 "--reference", "identity", "--trend-axis", "params"]) == 0
    doc = json.loads(capsys.readouterr().out)  # stdout is one JSON document and nothing else
    assert doc["reference"] == "identity" and doc["options"]["trend_axis"] == "params"
    assert {g["arm"] for g in doc["gaps"]} == {"linear", "nonlinear"}
    assert all(g["improvement"]["value"] > 0 for g in doc["gaps"])  # identity is the worst arm here
    assert Path(doc["plots"]["loss_vs_step"]).is_file()


def test_compare_same_seed_same_report(sweep, tmp_path):
    for name in ("a", "b"):
        assert main(["compare", str(sweep), "--out", str(tmp_path / name), "--bootstrap", "200"]) == 0
    assert (tmp_path / "a" / "report.md").read_text() == (tmp_path / "b" / "report.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--reference", "preproj"], "--reference 'preproj': no compared runs have that arm"),
        (["--bootstrap", "0"], "--bootstrap: must be positive"),
    ],
)
def test_compare_bad_input_exits_2_with_one_line(sweep, tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "nlq_scale.cli", "compare", str(sweep), "--out", str(tmp_path / "o"), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_compare_of_an_empty_root_exits_2(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert "no runs found" in capsys.readouterr().err


def test_report_logged_to_wandb_offline(sweep, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    comp = compare(load_runs([str(sweep)]), Options(resamples=100))
    paths = write_report(comp, tmp_path / "report")
    run_dir = Path(log_to_wandb(comp, paths, "nlq-test")).parent
    records = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                             capture_output=True, text=True, check=True).stdout
    logged = set()
    for line in records.splitlines():
        rec = json.loads(line)
        if rec["type"] == "history":
            logged |= {key.split(".")[0] for key in rec["history"]["item"]}
    assert {"analysis/cells", "analysis/gaps", "analysis/loss_vs_step", "analysis/relative_improvement"} <= logged
    (table,) = run_dir.glob("files/media/table/analysis/cells_*.table.json")
    assert len(json.loads(table.read_text())["data"]) == len(comp.cells)
    # the analysis run is not mistaken for a training run
    with pytest.raises(UsageError, match="no runs found"):
        load_runs([str(run_dir)])


def _fit_csv(tmp_path, text):
    csv = tmp_path / "points.csv"
    csv.write_text(text)
    return ["fit", "--csv", str(csv), "--params-col", "N", "--tokens-col", "D", "--loss-col", "L"]


def test_fit_from_tokens_with_bootstrap(tmp_path, capsys):
    rng = np.random.default_rng(0)
    N = np.repeat(np.geomspace(1e7, 1e9, 5), 4)
    D = np.tile(np.geomspace(1e9, 1e11, 4), 5)
    L = (1.8 + 500 / N**0.34 + 2000 / D**0.36) * np.exp(rng.normal(0, 0.002, N.size))
    rows = "\n".join(f"{n},{d},{l}" for n, d, l in zip(N, D, L))
    args = [*_fit_csv(tmp_path, "N,D,L\n" + rows + "\n"), "--bootstrap", "4", "--start-grid", SMALL_GRID]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "20 points" in out and "95% CI" in out
    assert "bootstrap: 4 resamples of the points (seed 0), each refit from 5 starts" in out
    assert "the intervals rest on 4" in out and "points inside delta" in out and "objective " in out
    assert "the chosen start converged" in out and "identifiable: no parameter on a bound" in out

    assert main([*args, "--json", "--huber-delta", "0.01", "--loss-space", "linear", "--ftol", "1e-12"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"] == {"huber_delta": 0.01, "loss_space": "linear", "start_grid": SMALL_GRID,
                               "start_grid_values": SMALL_GRID, "starts": 4, "ftol": 1e-12, "gtol": 1e-12,
                               "maxiter": 10000}
    assert doc["diagnostics"]["inside_delta"] == 20  # delta 0.01 in nats: every residual is inside
    boot = doc["bootstrap"]
    assert (boot["kept"], boot["failed"], boot["collapsed"], boot["starts_per_resample"]) == (4, 0, 0, 5)
    assert doc["fit"]["E"] == pytest.approx(1.8, rel=0.05)


SMALL_GRID = "a=0,10; b=0,10; e=0; alpha=0.5; beta=0.5"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty CSV"),
        ("N,D\n1,2\n", "missing column(s) L"),
        ("N,D,L\n1e6,1e9,\n", "column L is empty on data row 1"),
        ("N,D,L\n1e6,1e9,-1\n", "column L must be positive and finite"),
        ("N,D,L\n1e6,1e9,3\n2e6,1e9,2.9\n", "2 point(s); L(N, D) has 5 parameters"),
    ],
)
def test_fit_bad_input_exits_2(tmp_path, capsys, text, message):
    assert main(_fit_csv(tmp_path, text)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--huber-delta", "0"], "--huber-delta: must be positive"),
        (["--gtol", "-1"], "--gtol: must be positive"),
        (["--start-grid", "a=0;b=0"], "--start-grid: start grid 'a=0;b=0': no values for e, alpha, beta"),
        (["--start-grid", "coarse"], "expected one of default, hoffmann"),
    ],
)
def test_fit_bad_options_exit_2(tmp_path, capsys, args, message):
    assert main([*_fit_csv(tmp_path, "N,D,L\n1e6,1e9,3\n"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_compare_strict_exits_1_on_a_collapsed_fit(tmp_path, capsys):
    make_sweep(tmp_path, power_law_truth(E=0.0, A=30.0, alpha=0.12), ["linear"], ["t1", "t2", "t3"], seeds=[0, 1])
    out = tmp_path / "report"
    assert main(["compare", str(tmp_path), "--out", str(out), "--bootstrap", "100"]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path), "--out", str(out), "--bootstrap", "100", "--strict"]) == 1
    err = capsys.readouterr().err
    assert "--strict: 2 fit(s) not identifiable from their points: linear on compute (E = " in err
    assert err.count("\n") == 1
    report = (out / "report.md").read_text()  # written before the exit
    assert "Fit of linear's loss on compute: not identifiable from these points: E = " in report
    summary = json.loads((out / "summary.json").read_text())
    assert not any(f["identifiable"] for f in summary["fits"]) and summary["fits"][0]["flags"]
