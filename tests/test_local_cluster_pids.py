"""slurm/local-cluster's pid files: a file left behind by a daemon that died (a killed container, a
crash) names a number that soon belongs to another process. start.sh must then start the daemon,
not take it as running, and stop.sh must leave that other process alone."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, ended

SCRIPTS = REPO / "slurm" / "local-cluster"


@pytest.fixture
def stranger():
    """A process that is not a SLURM daemon, standing in for one that reused a dead daemon's pid."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def alive(pidfile: Path) -> bool:
    script = f'source "{SCRIPTS / "pids.sh"}"; alive "{pidfile}"'
    return subprocess.run(["bash", "-c", script]).returncode == 0


def test_a_pid_file_counts_only_for_its_own_daemon(tmp_path, stranger):
    for name in ("slurmd-node2.pid", "slurmctld.pid", "munged.pid"):
        (tmp_path / name).write_text(f"{stranger.pid}\n")
        assert not alive(tmp_path / name), name
    # The same check passes for the program a file is named for.
    (tmp_path / "sleep.pid").write_text(f"{stranger.pid}\n")
    assert alive(tmp_path / "sleep.pid")
    for junk in ("", "abc\n", "999999999\n"):
        (tmp_path / "slurmd-node1.pid").write_text(junk)
        assert not alive(tmp_path / "slurmd-node1.pid"), junk


def test_a_zombie_daemon_is_not_running(tmp_path):
    """A daemon killed a moment ago keeps its name in /proc until it is reaped."""
    zombie = subprocess.Popen(["sleep", "0"])
    while not ended(zombie.pid):  # exited, not yet reaped (no wait()): a zombie
        time.sleep(0.01)
    (tmp_path / "sleep.pid").write_text(f"{zombie.pid}\n")
    try:
        assert not alive(tmp_path / "sleep.pid")
    finally:
        zombie.wait()


def test_stop_leaves_a_process_that_reused_a_daemons_pid_alone(tmp_path, stranger):
    (tmp_path / "munge").mkdir()
    for name in ("slurmd-node1.pid", "slurmctld.pid", "munge/munged.pid"):
        (tmp_path / name).write_text(f"{stranger.pid}\n")
    out = subprocess.run(["bash", str(SCRIPTS / "stop.sh")], env={"PATH": "/usr/bin:/bin", "NLQ_SLURM_STATE": str(tmp_path)},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert stranger.poll() is None  # still running
    assert not list(tmp_path.rglob("*.pid"))  # the stale files are gone
