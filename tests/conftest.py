"""Shared test helpers. Multi-process tests are marked `slow` (run in CI; skip locally with
`make test-fast`). `make test` runs two pytest-xdist workers with `--dist loadfile` (a file's tests,
and its module fixtures, stay on one worker); tests on the local SLURM cluster take a lock for their
duration (tests/test_cluster_slurm.py: slurm_cluster), so that one test's jobs are never another's,
and the files holding them go to one worker together (SLURM_FILES), which would otherwise wait idle
for the other's."""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import json
import multiprocessing
import multiprocessing.context
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nlq_scale.runtime.allocator import PRELOAD, TCMALLOC, preload_env

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"

# A small model that still exercises GQA-free multi-head attention with TP=2 and PP=2.
TINY_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.kv_channels=16",
    "model.seq_length=32",
    "model.vocab_size=300",
    "model.make_vocab_size_divisible_by=8",
    "model.bf16=false",  # the 124m scale trains in bf16; exactness tests compare in fp32
]


# What runtime.cpu_allocator: auto gives a training process on this machine with no LD_PRELOAD of
# its own, and in this test session's environment (a user's LD_PRELOAD wins: `make test-portability`
# runs the suite with glibc's malloc that way).
INSTALLED_ALLOCATOR = "tcmalloc" if ctypes.util.find_library(TCMALLOC) else "system"
AUTO_ALLOCATOR = next((name for name in ("tcmalloc", "jemalloc")
                       if f"lib{name}" in preload_env("auto", dict(os.environ)).get(PRELOAD, "")), "system")  # fmt: skip

SLURM_FILES = frozenset({"tests/test_cluster_reliability.py", "tests/test_cluster_slurm.py",
                         "tests/test_data_parallel_prepare.py"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slurm") and item.nodeid.split("::")[0] not in SLURM_FILES:
            raise pytest.UsageError(f"{item.nodeid}: a test on the SLURM cluster outside tests/conftest.py's SLURM_FILES")


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadfile, the SLURM files one unit. (xdist's loadgroup would do it by marks, but it
    renames items through an attribute pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlurmFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "slurm" if scope in SLURM_FILES else scope

    return SlurmFilesTogether(config, log)


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path_factory, monkeypatch):
    """W&B never leaves the machine in tests, and keeps its files in a private dir."""
    base = tmp_path_factory.getbasetemp() / "wandb-home"
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(base / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def nlq(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `nlq-scale` CLI in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "nlq_scale.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=(os.environ | (env or {})),
        cwd=REPO,
    )


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The `nlq-scale` command in this process: the main() the console script calls, without a new
    interpreter's imports (~10 s a command). For commands that run in one process (export, generate,
    import-nanogpt, refusals); what starts ranks or jobs goes through `nlq`. A command's one-process
    distributed block would end a process group the test holds, so there must be none."""
    import io

    import torch.distributed as dist

    from nlq_scale.cli import main

    assert not dist.is_initialized(), "cli() inside a process group (the single_rank fixture): use nlq()"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _environ(env or {}):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's refusals and --help
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["nlq-scale", *args], code, out.getvalue(), err.getvalue())


def refused(*args: str) -> str:
    """The command's one-line refusal (exit 2)."""
    r = cli(*args)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr


@contextlib.contextmanager
def _environ(changes: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """torch.distributed and megatron's parallel state at one rank (TP = PP = 1). The engines the
    block built (tests/scripts/deepspeed_engine.py) are closed with it: an engine left open keeps
    its process groups, and their gloo threads, for the rest of the pytest worker."""
    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.runtime.dist import distributed
    from tests.scripts.deepspeed_engine import close_all

    with distributed(ParallelConfig()):
        try:
            yield
        finally:
            close_all()


@pytest.fixture
def single_rank():
    """one_rank() for one test."""
    with one_rank():
        yield


# What the rank scripts import, loaded once per pytest worker by the forkserver the ranks are forked
# from: ~7 CPU-s a megatron rank and ~10 a DeepSpeed one (the Muon module DeepSpeed's ZeRO imports
# compiles at import) that ~60 ranks would each pay again. A name upstream renames is skipped.
ZYGOTE_PRELOAD = [
    "torch", "torch._dynamo", "megatron.core", "deepspeed", "deepspeed.runtime.zero.muon.original_muon",
    "nlq_scale.train.engine_megatron", "nlq_scale.train.engine_deepspeed", "tests.scripts.deepspeed_engine",
]  # fmt: skip


@functools.cache
def _zygote() -> multiprocessing.context.ForkServerContext:
    """The forkserver, started on the allocator the ranks run (rank_env's LD_PRELOAD, fixed when a
    process starts). It imports, never computes, so its child has no thread pool or process group."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(ZYGOTE_PRELOAD)
    from multiprocessing import forkserver

    with _environ(preload_env("auto", dict(os.environ))):
        forkserver.ensure_running()
    return context


def _rank_main(script: str, args: list[str], env: dict[str, str], log: str) -> None:
    """A rank forked from the zygote: the environment, output and arguments of `python script args`.
    The intra-op threads are set here, since the OMP_NUM_THREADS the zygote started with is read once."""
    import runpy

    import torch

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    out = os.open(log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


class _Forked:
    """A forked rank through the part of subprocess.Popen's interface launch.wait_ranks uses."""

    def __init__(self, process: multiprocessing.Process):
        self.process = process

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout)
        return self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()


def run_ranks(script: str, nproc: int, *args: str, timeout: float = 600) -> None:
    """Run tests/scripts/<script> as `nproc` gloo ranks, forked from the zygote; fail with the ranks'
    output otherwise. A rank that fails stops the others at once (a lone rank would wait for its
    peers until the timeout)."""
    from nlq_scale.runtime.launch import hosted_store, rank_env, wait_ranks

    context = _zygote()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs, hosted_store() as port:
        paths = [Path(logs) / f"rank{r}.log" for r in range(nproc)]  # a pipe could fill and block
        procs = []
        for r, path in enumerate(paths):
            path.touch()
            process = context.Process(
                target=_rank_main, args=(str(SCRIPTS / script), list(args), rank_env(r, nproc, port), str(path)),
                name=f"rank{r}",
            )  # fmt: skip
            process.start()
            procs.append(_Forked(process))
        code = wait_ranks(procs, grace_s=10, timeout_s=timeout)
        outputs = [path.read_text() for path in paths]
    if code != 0:
        exits = ", ".join(f"rank {i} exited {p.returncode}" for i, p in enumerate(procs) if p.returncode)
        problem = f"ranks still running after {timeout:.0f} s" if code is None else exits
        tails = "\n".join(f"--- rank {i}\n{out[-3000:]}" for i, out in enumerate(outputs))
        pytest.fail(f"{script}: {problem}:\n{tails}")


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory) -> Path:
    """The bundled sample corpus prepared at seq_length 64 (the cpu-* scales), once per session."""
    out = tmp_path_factory.mktemp("data") / "sample-64"
    r = nlq("prepare-data", "--sample", "--out", str(out), "--seq-len", "64", "--no-progress")
    assert r.returncode == 0, r.stderr
    return out


def process_state(pid: int) -> str | None:
    """The state letter /proc gives process `pid` (R, S, T stopped, Z zombie, ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def ended(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet (which `kill -0` still finds)."""
    return process_state(pid) in (None, "Z")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mark_killed(run_dir: Path, **fields: object) -> None:
    """status.json as a run killed before it completed leaves it (still running), so a relaunch
    resumes from its checkpoints instead of finding nothing to do."""
    path = run_dir / "status.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"state": "running", **fields}))


def last_by_step(records: list[dict], key: str) -> dict[int, object]:
    """The last value logged for `key` at each step (a resumed run re-logs the steps it redoes)."""
    return {r["step"]: r[key] for r in records if key in r}
