"""What a new user meets in the first hour (issue 59): a path that is a file gets one line, what the
commands write for others is readable by others, training says what it does, and an interrupted run
does not get in the way of `compare` or `status`."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.analysis_rundirs import make_sweep, power_law_truth
from tests.conftest import REPO, refused

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
