"""runtime.cpu_allocator: the rank processes `--nproc` starts run tcmalloc where it is installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nlq_scale.runtime.allocator import PRELOAD, preload_env
from nlq_scale.runtime.launch import launch_local
from tests.conftest import INSTALLED_ALLOCATOR

# A rank that exits 0 only when it runs the allocator named in its argument.
RANK = ["-c", "import sys; from nlq_scale.runtime.allocator import loaded_allocator as a; sys.exit(a() != sys.argv[1])"]


CHOICES = [("auto", INSTALLED_ALLOCATOR), ("system", "system")]


@pytest.mark.parametrize("choice, runs", CHOICES)
def test_launched_ranks_run_the_chosen_allocator(choice, runs, monkeypatch):
    monkeypatch.delenv(PRELOAD, raising=False)
    assert launch_local([*RANK, runs], 2, choice) == 0
    other = "system" if runs == "tcmalloc" else "tcmalloc"
    assert launch_local([*RANK, other], 1, choice) != 0  # the check itself can fail


def test_a_users_preload_wins():
    env = {PRELOAD: "libjemalloc.so.2", "PATH": "/bin"}
    assert preload_env("auto", env) == env
    assert preload_env("system", {"PATH": "/bin"}) == {"PATH": "/bin"}



@pytest.mark.parametrize("choice, runs", CHOICES)
def test_a_script_restarts_on_the_chosen_allocator(choice, runs, tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(
        "import sys\n"
        "from nlq_scale.runtime.allocator import loaded_allocator, restart_with\n"
        "restart_with(sys.argv[1])\n"
        "print(loaded_allocator(), sys.argv[1:])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != PRELOAD}
    proc = subprocess.run([sys.executable, str(script), choice], env=env, capture_output=True, text=True, check=True)
    allocator, _, args = proc.stdout.strip().partition(" ")
    assert allocator == runs and args == f"['{choice}']"  # restarted with the same arguments
