"""What a new user meets in the first hour (issue 59): a path that is a file gets one line, what the
commands write for others is readable by others, training says what it does, and an interrupted run
does not get in the way of `compare` or `status`."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.analysis_rundirs import make_config, make_sweep, power_law_truth, write_run_dir
from tests.conftest import REPO, cli, nlq, refused
from tests.test_data_helpers import documents, write_jsonl

# ---------------------------------------------------------------------------------------------
# 1. a path that exists as a regular file where a directory is wanted

DIRECTORY_FLAGS = {  # command: its arguments, OUT the directory it writes, the other inputs real (INPUTS)
    "train": ("train", "--scale", "cpu-xs", "--arm", "linear", "--run-dir", "OUT", "data.path=DATA"),
    "submit": ("submit", "configs/sweeps/lr-transfer-cpu.yaml", "--root", "OUT", "--executor", "local", "data.path=DATA"),
    "compare": ("compare", "RUNS", "--out", "OUT"),
    "import-csv": ("import-csv", "CSV", "--arm", "linear", "--scale", "124m", "--seed", "1", "--out", "OUT"),
    "export": ("export", "RUNS", "--out", "OUT"),
    "import-nanogpt": ("import-nanogpt", "ckpt.pt", "--out", "OUT"),
    "prepare-data": ("prepare-data", "--sample", "--seq-len", "64", "--out", "OUT"),
    "doctor": ("doctor", "--work-dir", "OUT"),
    "quickstart": ("quickstart", "--root", "OUT"),
    "status": ("status", "OUT"),
    "cancel": ("cancel", "OUT"),
}
INPUTS = {  # placeholder: what makes it real, from the test's tmp_path and request
    "DATA": lambda tmp, request: request.getfixturevalue("sample_dataset"),
    "RUNS": lambda tmp, request: make_sweep(tmp / "runs", power_law_truth(2.0, 50.0, 0.1), ["linear"], ["t1"], [1])
    and tmp / "runs",
    "CSV": lambda tmp, request: write_csv(tmp / "log.csv"),
}


def write_csv(path: Path) -> Path:
    path.write_text("step,val_loss\n10,5.0\n20,4.5\n")
    return path


@pytest.mark.parametrize("command", DIRECTORY_FLAGS)
def test_a_file_where_a_directory_goes_is_one_line_and_kept(command, tmp_path, monkeypatch, request):
    monkeypatch.chdir(REPO)
    a_file = tmp_path / "afile"
    a_file.write_text("kept")
    args = [a.replace("OUT", str(a_file)) for a in DIRECTORY_FLAGS[command]]
    for placeholder, made in INPUTS.items():
        if any(placeholder in a for a in args):
            value = str(made(tmp_path, request))
            args = [a.replace(placeholder, value) for a in args]
    err = refused(*args)
    assert str(a_file) in err and re.search(r"not an? (empty )?directory", err), err
    assert a_file.read_text() == "kept"


# ---------------------------------------------------------------------------------------------
# 2. what is written for others: the modes of any other file of the user (umask 022: 0644 / 0755)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def unreadable_to_others(root: Path) -> list[str]:
    """What under `root` is not as a plain file (0644) or directory (0755) of the user is, under umask 022."""
    paths = [root, *root.rglob("*")]
    modes = {p: stat.S_IMODE(p.lstat().st_mode) for p in paths if not p.is_symlink()}
    return [f"{mode:o} {p}" for p, mode in modes.items() if mode != (0o755 if p.is_dir() else 0o644)]


def test_compare_writes_a_report_others_can_read(tmp_path, umask_022):
    make_sweep(tmp_path / "runs", power_law_truth(2.0, 50.0, 0.1, {"nonlinear": 1.2}), ["linear", "nonlinear"],
               ["t1", "t2"], [1, 2])
    r = cli("compare", str(tmp_path / "runs"), "--out", str(tmp_path / "report"), "--bootstrap", "50")
    assert r.returncode == 0, r.stderr
    assert unreadable_to_others(tmp_path / "report") == []


def test_import_csv_writes_a_run_directory_others_can_read(tmp_path, umask_022):
    r = cli("import-csv", str(write_csv(tmp_path / "log.csv")), "--arm", "linear", "--scale", "124m", "--seed", "1", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert unreadable_to_others(tmp_path / "out") == []


def test_prepare_data_writes_a_dataset_others_can_read(tmp_path, umask_022):
    docs = write_jsonl(tmp_path / "docs.jsonl", documents(60))
    r = cli("prepare-data", "--source", "jsonl", "--input", str(docs), "--out", str(tmp_path / "ds"), "--seq-len", "64",
            "--val-fraction", "0.2", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert unreadable_to_others(tmp_path / "ds") == []


# ---------------------------------------------------------------------------------------------
# 3. plots of one scale, one seed: what is not there is said, what is there is not stretched


def test_a_one_scale_one_seed_plot_says_what_it_lacks(tmp_path):
    from nlq_scale.analysis import plots
    from nlq_scale.analysis.compare import Options, compare
    from nlq_scale.analysis.runs import load_runs

    make_sweep(tmp_path, power_law_truth(2.0, 50.0, 0.1), ["linear", "linear-mlp4.75"], ["t1"], [1])
    figures = plots.figures(compare(load_runs([str(tmp_path)]), Options(resamples=50)))
    (ax,) = figures["loss_vs_compute"].axes
    figures["loss_vs_compute"].canvas.draw()
    assert "with fitted" not in ax.get_title() and "no curve fitted" in ax.get_title()
    assert "one seed" in ax.get_ylabel()
    assert any(label.get_text() for label in ax.get_xticklabels()), "no tick label on the x axis"
    lo, hi = np.log10(ax.get_xlim())
    x = np.log10(np.unique([line.get_xdata()[0] for line in ax.lines if len(line.get_xdata()) == 1]))
    assert x.size == 2 and min(x - lo) >= 0.25 and min(hi - x) >= 0.25, (lo, hi, x)  # not at the edges
    (step_ax,) = figures["loss_vs_step"].axes
    assert all("1 seed)" in t.get_text() for t in step_ax.get_legend().get_texts())
    for fig in figures.values():
        plots.close(fig)


# ---------------------------------------------------------------------------------------------
# one real run (cpu-xs, a few steps, W&B offline) for what training prints, exports and leaves behind

DOC = REPO / "docs" / "getting-started.md"
DOC_RUN_DIR, DOC_DATA = "runs/first", "data/sample-64"
TRANSCRIPT_ARGS = ("train", "--scale", "cpu-xs", "--arm", "linear", "--run-dir", DOC_RUN_DIR, f"data.path={DOC_DATA}",
                   "train.steps=6", "train.warmup_steps=2", "train.eval_every=3", "train.log_every=2")
TRANSCRIPT = re.compile(r"(?<=<!-- transcript: train -->\n)```text\n(?P<body>.*?)```", re.S)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, sample_dataset) -> tuple[Path, str]:
    """The documented run trained under umask 022: its run directory and what it printed (stdout and
    stderr, in order)."""
    run_dir = tmp_path_factory.mktemp("first") / "runs" / "first"
    args = [a.replace(DOC_RUN_DIR, str(run_dir)).replace(DOC_DATA, str(sample_dataset)) for a in TRANSCRIPT_ARGS]
    old = os.umask(0o022)
    try:
        r = subprocess.run([sys.executable, "-m", "nlq_scale.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=600,
                           env=os.environ | {"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stdout[-3000:]
    printed = r.stdout.replace(str(run_dir), DOC_RUN_DIR).replace(str(sample_dataset), DOC_DATA)
    return run_dir, printed


@pytest.mark.slow  # trains
def test_a_run_and_its_export_are_readable_by_others(first_run, tmp_path, umask_022):
    run_dir, _ = first_run
    assert unreadable_to_others(run_dir) == []
    r = cli("export", str(run_dir), "--out", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr
    assert unreadable_to_others(tmp_path / "export") == []


# ---------------------------------------------------------------------------------------------
# 4. what training prints


def normalised(text: str) -> list[str]:
    """Lines without what changes from run to run or machine to machine: decimals (losses, times,
    speeds), thousands-separated counts of tok/s, the W&B run's timestamped directory."""
    text = re.sub(r"offline-run-\S+", "offline-run-*", text)
    text = re.sub(r"\d[\d,]*\.\d+|\d[\d,]*(?= tok/s)", "#", text)
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def transcript(printed: str) -> str:
    return f"$ nlq-scale {' '.join(TRANSCRIPT_ARGS)}\n{printed}"


@pytest.mark.slow  # trains
def test_getting_started_shows_what_a_run_prints(first_run):
    """docs/getting-started.md's transcript is a real run's output (NLQ_SCALE_WRITE_DOCS=1 writes it)."""
    _, printed = first_run
    doc = DOC.read_text()
    if os.environ.get("NLQ_SCALE_WRITE_DOCS") == "1":
        doc = TRANSCRIPT.sub(lambda m: f"```text\n{transcript(printed)}```", doc)
        DOC.write_text(doc)
    shown = TRANSCRIPT.search(doc)
    assert shown, f"{DOC}: no transcript after <!-- transcript: train -->"
    assert normalised(shown["body"]) == normalised(transcript(printed))


@pytest.mark.slow  # trains
def test_a_run_says_what_it_trains_its_validation_and_where_it_ended(first_run):
    run_dir, printed = first_run
    lines = printed.splitlines()
    head = "\n".join(lines[:6])
    for expected in ("linear at cpu-xs", "parameters", "tokens per step", "layout:", "lr 0.003",
                     f"run directory: {DOC_RUN_DIR}", f"W&B offline: files in {DOC_RUN_DIR}/wandb",
                     f"wandb sync {DOC_RUN_DIR}/wandb/offline-run-*"):
        assert expected in head, (expected, head)
    assert re.findall(r"^step (\d+)/6 val loss \d+\.\d{4} ± \d\.\d{4}$", printed, re.M) == ["3", "6"], printed
    assert re.fullmatch(rf"\[nlq-scale\] completed at step 6: val loss \d+\.\d{{4}}; run directory {DOC_RUN_DIR}",
                        lines[-1]), lines[-1]


@pytest.mark.slow  # trains
def test_rerunning_a_finished_run_says_there_is_nothing_to_do(first_run):
    run_dir, _ = first_run
    metrics = (run_dir / "metrics.jsonl").read_text()
    r = cli("train", "--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert f"nothing to do: {run_dir} already completed its 6 steps" in r.stderr
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_help_describes_the_tool_for_users():
    text = " ".join(cli("--help").stdout.split())
    assert "compare their scaling curves" in text and "cli.py" not in text


def test_compare_prints_its_findings(tmp_path):
    make_sweep(tmp_path / "runs", power_law_truth(2.0, 50.0, 0.1, {"nonlinear": 1.2}), ["linear", "nonlinear"],
               ["t1", "t2"], [1, 2])
    r = cli("compare", str(tmp_path / "runs"), "--bootstrap", "50")
    assert r.returncode == 0, r.stderr
    assert "nonlinear vs linear" in r.stdout.split("report:")[0], r.stdout


# ---------------------------------------------------------------------------------------------
# 5. an interrupted run


def killed_copy(where: Path) -> Path:
    """What a SIGKILLed second launch of the same run leaves: its config, part of its curve, status running."""
    cfg = make_config("linear", "t1", 1, 1e-3)
    return write_run_dir(where, cfg, np.array([20, 40]), np.array([6.0, 5.0]), state="running")


def test_compare_prefers_the_completed_run_to_a_killed_copy(tmp_path):
    make_sweep(tmp_path / "runs", power_law_truth(2.0, 50.0, 0.1), ["linear"], ["t1"], [1, 2])
    copy = killed_copy(tmp_path / "elsewhere")
    r = cli("compare", str(tmp_path / "runs"), str(tmp_path / "elsewhere"), "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    assert f"set aside {copy}" in r.stderr and "completed" in r.stderr


def test_compare_leaves_out_runs_by_id_or_path(tmp_path):
    runs = make_sweep(tmp_path / "runs", power_law_truth(2.0, 50.0, 0.1), ["linear"], ["t1"], [1, 2, 3])
    shutil.copytree(runs[0], tmp_path / "again" / "one")  # two completed copies: which one is for the user to say
    err = refused("compare", str(tmp_path / "runs"), str(tmp_path / "again"), "--out", str(tmp_path / "report"))
    assert "--exclude" in err
    r = cli("compare", str(tmp_path / "runs"), str(tmp_path / "again"), "--exclude", str(tmp_path / "again" / "one"),
            "--exclude", runs[1].name, "--json", "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    (cell,) = json.loads(r.stdout)["cells"]
    assert cell["seeds"] == [1, 3]
    assert "--exclude nothing" in refused("compare", str(tmp_path / "runs"), "--exclude", "nothing")


def test_status_shows_a_local_run_whose_process_is_gone_as_dead(tmp_path):
    """The run's process records itself in status.json and dies (as under SIGKILL) while running."""
    run_dir = tmp_path / "root" / "run"
    run_dir.mkdir(parents=True)
    code = ("import sys; from pathlib import Path; from nlq_scale.train.rundir import Status\n"
            "Status(Path(sys.argv[1]), 10, 1).update(state='running')\n")
    subprocess.run([sys.executable, "-c", code, str(run_dir)], check=True, cwd=REPO)
    r = cli("status", str(tmp_path / "root"), "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["runs"]
    assert row["state"] == "dead" and socket.gethostname() in row["error"], row


# ---------------------------------------------------------------------------------------------
# 6. smaller things


def test_an_unknown_key_names_the_near_one():
    assert "train.step: unknown key (did you mean train.steps?)" in refused(
        "config", "show", "--scale", "cpu-xs", "--arm", "linear", "train.step=5")


def test_deepspeed_says_nothing_of_its_accelerator_by_default():
    code = ("from nlq_scale.runtime.quiet import quiet_libraries\nquiet_libraries()\n"
            "from deepspeed.accelerator import get_accelerator\nget_accelerator()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={k: v for k, v in os.environ.items() if k != "NLQ_SCALE_VERBOSE"})
    assert out.returncode == 0, out.stderr
    assert "accelerator" not in out.stdout + out.stderr
