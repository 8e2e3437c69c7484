"""The command line explains itself: defaults in the help, an example per sweep/analysis command, and
`--verbose` keeps the library warnings that are hidden by default; a command refuses, in one line and
before any work, a place it cannot write."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, nlq, refused

EXAMPLED = ("train", "plan", "submit", "status", "cancel", "compare", "fit", "import-csv", "quickstart", "design")


@pytest.mark.parametrize("command", EXAMPLED)
def test_help_has_an_example(command):
    r = nlq(command, "--help")
    assert r.returncode == 0, r.stderr
    assert f"example:\n  nlq-scale {command} " in r.stdout


def test_help_shows_defaults():
    r = nlq("submit", "--help")
    assert "(default: slurm)" in " ".join(r.stdout.split())


def _library_warnings_hidden(*flags: str) -> bool:
    code = (
        "import warnings\nfrom nlq_scale.cli import main\n"
        f"main([*{list(flags)!r}, 'params', '--scale', 'cpu-xs', '--arm', 'linear'])\n"
        "print(any('megatron' in getattr(f[3], 'pattern', f[3] or '') for f in warnings.filters))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


def test_verbose_keeps_library_warnings():
    assert _library_warnings_hidden()
    assert not _library_warnings_hidden("--verbose")


@pytest.mark.parametrize("command", [("train",), ("params",), ("config", "show")])
def test_scale_and_arm_help_list_the_known_names(command):
    text = " ".join(nlq(*command, "--help").stdout.split())
    assert "known: 1.3b, 124m, 13b, 175b, 2.7b, 350m, 6.7b, 760m, cpu-m, cpu-s, cpu-w128, cpu-w256, cpu-w64, cpu-xs" in text
    assert "linear, linear-matched, linear-mlp4.75, linear-mup, nonlinear" in text


def test_an_unknown_sweep_lists_the_known_ones():
    r = nlq("plan", "no-such-sweep")
    assert r.returncode == 2
    assert "not found (known: ladder, lr-transfer-cpu, paper-124m, smoke" in r.stderr



UNCREATABLE = "/proc/nlq-scale-out"  # procfs: no file can be created there, not even by root

WRITERS = {  # command: its arguments, OUT where it writes
    "train": ("train", "--scale", "cpu-xs", "--arm", "linear", "--run-dir", "OUT"),
    "submit": ("submit", "configs/sweeps/lr-transfer-cpu.yaml", "--root", "OUT", "--executor", "local"),
    "compare": ("compare", "runs", "--out", "OUT"),
    "import-csv": ("import-csv", "log.csv", "--arm", "linear", "--scale", "124m", "--seed", "1", "--out", "OUT"),
    "export": ("export", "runs/x", "--out", "OUT"),
    "import-nanogpt": ("import-nanogpt", "ckpt.pt", "--out", "OUT"),
    "prepare-data": ("prepare-data", "--sample", "--seq-len", "64", "--out", "OUT"),
    "coord-check": ("coord-check", "--arm", "linear", "--png", "OUT/coord.png"),
    "doctor": ("doctor", "--work-dir", "OUT"),
    "quickstart": ("quickstart", "--root", "OUT"),
}


@pytest.mark.parametrize("command", WRITERS)
def test_a_place_that_cannot_be_written_is_refused_before_any_work(command, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = WRITERS[command]
    flag = args[[i for i, a in enumerate(args) if "OUT" in a][0] - 1]
    err = refused(*[a.replace("OUT", UNCREATABLE) for a in args])
    assert f"{flag} {UNCREATABLE}" in err and "cannot create files in /proc" in err
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    err = refused(*[a.replace("OUT", str(a_file / "below")) for a in args])
    assert f"{flag} {a_file}/below" in err and f"{a_file} is not a directory" in err
    assert a_file.read_text() == "kept"
