"""Training must-shows on CPU at the tiny scale: bit-exact resume after SIGKILL, resume at another
world size, identical streams across arms, truncated checkpoints, divergence, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import AUTO_ALLOCATOR, REPO, SCRIPTS, last_by_step, mark_killed, nlq, read_metrics

STEPS = 12  # CI time: each of this file's 2-rank runs trains this many steps
CHECKPOINT = 6  # the step the kill tests wait for
EVAL_EVERY = 3


def train_args(run_dir: Path, data: Path, arm: str = "nonlinear", *extra: str) -> list[str]:
    """Every run under the device check (runtime.check_device): these runs are also the GPU path's
    check for TP, PP, DP, EP, kills and resumes on both engines (tests/test_device.py)."""
    return [
        "train", "--scale", "cpu-xs", "--arm", arm, "--run-dir", str(run_dir),
        f"data.path={data}", f"train.steps={STEPS}", f"train.eval_every={EVAL_EVERY}", f"checkpoint.every={CHECKPOINT}",
        "checkpoint.keep=3", "logging.wandb=false", "runtime.check_device=true", *extra,
    ]  # fmt: skip


def start(args: list[str], nproc: int, entry: tuple[str, ...] = ("-m", "nlq_scale.cli")) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *entry, *args, "--nproc", str(nproc)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def kill_after_checkpoint(run_dir: Path, args: list[str], nproc: int, step: int) -> None:
    """Start a run and SIGKILL its whole process group once checkpoint `step` is complete."""
    proc = start(args, nproc)
    marker = run_dir / "checkpoints" / f"step_{step}" / "complete.json"
    deadline = time.time() + 600
    while not marker.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "checkpoint never appeared"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_to_end(args: list[str], nproc: int) -> str:
    proc = start(args, nproc)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return out


def model_tensors(engine: str, ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model weights in a checkpoint, whatever engine wrote it."""
    if engine == "deepspeed":
        (states,) = (ckpt / "deepspeed").rglob("mp_rank_00_model_states.pt")
        module = torch.load(states, weights_only=False)["module"]
        return {k: v for k, v in module.items() if isinstance(v, torch.Tensor)}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if not k.startswith("optimizer.") and isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module", params=["megatron", "deepspeed"])
def uninterrupted(request, tmp_path_factory, sample_dataset) -> tuple[str, Path]:
    """(engine, run dir) of a 2-rank run trained straight through, with a named validation set (the
    data's own val split again, given in tokens)."""
    engine = request.param
    run_dir = tmp_path_factory.mktemp("train") / f"uninterrupted-{engine}"
    again = f"data.validation=[{{name: again, path: {sample_dataset}, tokens: 1024}}]"
    run_to_end(train_args(run_dir, sample_dataset, "nonlinear", f"train.engine={engine}", again), 2)
    return engine, run_dir


@pytest.mark.slow
def test_named_validation_set_is_logged_beside_the_main_one(uninterrupted):
    """A named set is evaluated like the fixed one: the same 16 sequences (1024 tokens at seq 64)
    give the same loss and standard error, at every eval, on both engines and across 2 DP ranks."""
    _, run_dir = uninterrupted
    records = [r for r in read_metrics(run_dir) if "val/loss" in r]
    assert [r["step"] for r in records] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    for r in records:
        assert r["val/again/loss"] == r["val/loss"] and r["val/again/loss_stderr"] == r["val/loss_stderr"] > 0, r


@pytest.fixture(scope="module")
def killed(uninterrupted, tmp_path_factory, sample_dataset) -> tuple[Path, Path]:
    """(run dir, a copy of it as it was killed) of `uninterrupted`'s run, SIGKILLed on 2 ranks once
    its step-CHECKPOINT checkpoint was complete. Streaming's lock dirs live in node-local scratch
    private to the run: the killed run leaves its own behind."""
    from nlq_scale.train.feed import job_tmp_dir

    engine, _ = uninterrupted
    run_dir = tmp_path_factory.mktemp("train") / f"killed-{engine}"
    kill_after_checkpoint(run_dir, train_args(run_dir, sample_dataset, "nonlinear", f"train.engine={engine}"), 2,
                          step=CHECKPOINT)  # fmt: skip
    assert job_tmp_dir(run_dir).is_dir()
    as_killed = shutil.copytree(run_dir, run_dir.with_name(f"{run_dir.name}-as-killed"))
    return run_dir, as_killed


@pytest.mark.slow
def test_sigkill_and_relaunch_is_bit_exact(uninterrupted, killed, sample_dataset, tmp_path):
    """...and the last rank out of a finished run removes its node-local scratch (`killed`)."""
    from nlq_scale.train.feed import job_tmp_dir

    engine, uninterrupted = uninterrupted
    run_dir, _ = killed
    out = run_to_end(train_args(run_dir, sample_dataset, "nonlinear", f"train.engine={engine}"), 2)
    assert not job_tmp_dir(run_dir).exists() and not job_tmp_dir(uninterrupted).exists()
    assert "resuming from" in out and f"step_{CHECKPOINT}" in out
    a, b = read_metrics(uninterrupted), read_metrics(run_dir)
    for key in ("train/loss", "val/loss", "data/hash"):
        want, got = last_by_step(a, key), last_by_step(b, key)
        assert [got[s] for s in sorted(got) if s > CHECKPOINT] == [want[s] for s in sorted(want) if s > CHECKPOINT], key
    assert any(r.get("event") == "resume" for r in b)
    # The --nproc ranks run tcmalloc where it is installed (runtime.cpu_allocator: auto); same bits.
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["allocator"] == AUTO_ALLOCATOR
    final_a = model_tensors(engine, uninterrupted / "checkpoints" / f"step_{STEPS}", tmp_path)
    final_b = model_tensors(engine, run_dir / "checkpoints" / f"step_{STEPS}", tmp_path)
    assert final_a.keys() == final_b.keys() and any("word_embeddings" in k for k in final_a)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


@pytest.mark.slow
def test_saved_at_two_ranks_resumes_at_one(uninterrupted, killed, sample_dataset, tmp_path):
    engine, uninterrupted = uninterrupted
    run_dir = tmp_path / "resharded"
    shutil.copytree(killed[1], run_dir)
    run_to_end(train_args(run_dir, sample_dataset, "nonlinear", f"train.engine={engine}"), 1)
    a, b = read_metrics(uninterrupted), read_metrics(run_dir)
    assert last_by_step(b, "data/hash") == last_by_step(a, "data/hash")  # same stream at dp 1 and 2
    want, got = last_by_step(a, "val/loss"), last_by_step(b, "val/loss")
    assert sorted(got) == sorted(want)
    for step in got:  # not bit-exact: the data-parallel reduction order changed
        assert abs(got[step] - want[step]) < 1e-4, (step, got[step], want[step])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["layout"]["world_size"] == 1 and manifest["layout"]["engine"] == engine
    # one rank in a process of its own (`nlq-scale train`) restarts itself on tcmalloc where it is installed
    assert manifest["allocator"] == AUTO_ALLOCATOR


# Layouts a checkpoint is saved at and resumed from at DP=2, per engine (DeepSpeed runs PP=1 only),
# and whether the run starts from other weights there: megatron seeds each pipeline stage's init.
SAVED_AT = {"megatron": (("parallel.tp=2", False), ("parallel.pp=2", True)), "deepspeed": (("parallel.tp=2", False),)}
# The TP=2 part also recomputes the query MLP in backward (its W2 all-reduce repeated), folds the
# query's RMSNorm into W1 (model.nlq.fuse_up) and, on megatron, runs sequence-parallel (the query's
# norms on sequence shards, one all-to-all to the heads): the same training within the tolerance,
# and operational keys a resume may change.
ALSO_AT = {("megatron", "parallel.tp=2"): ("parallel.recompute_query=true", "parallel.sequence_parallel=true",
                                           "model.nlq.fuse_up=true"),
           ("deepspeed", "parallel.tp=2"): ("parallel.recompute_query=true", "model.nlq.fuse_up=true")}  # fmt: skip


@pytest.mark.slow
def test_saved_at_tp2_or_pp2_resumes_at_dp2_within_tolerance(uninterrupted, sample_dataset, tmp_path):
    """Resharding across TP and PP on resume: the same stream, every val loss within 1e-4 of a run
    trained straight through from the same start (the summation order differs, so not bit-exact),
    the change recorded. PP=2 puts the tied embedding in a bucket of its own: the case
    megatron-core 0.16.1 saved wrongly (compat.megatron_optimizer.in_place_optimizer_state)."""
    engine, uninterrupted = uninterrupted
    for saved_at, own_init in SAVED_AT[engine]:
        args = train_args(tmp_path / saved_at, sample_dataset, "nonlinear", f"train.engine={engine}")
        straight = uninterrupted
        also = ALSO_AT.get((engine, saved_at), ())
        before = [saved_at, *also]
        if own_init:  # its own straight run, whose step-CHECKPOINT checkpoint is also the one resumed
            straight = tmp_path / f"{saved_at}-straight"
            run_to_end([*train_args(straight, sample_dataset, "nonlinear", f"train.engine={engine}"), *before], 2)
            shutil.copytree(straight, tmp_path / saved_at)
            shutil.rmtree(tmp_path / saved_at / "checkpoints" / f"step_{STEPS}")
            mark_killed(tmp_path / saved_at)
        else:
            kill_after_checkpoint(tmp_path / saved_at, [*args, *before], 2, step=CHECKPOINT)
        key, value = saved_at.split("=")
        saved_layout = layout(tmp_path / saved_at)
        out = run_to_end(args, 2)
        assert "resuming from" in out and f"step_{CHECKPOINT}" in out.split("resuming from", 1)[1].splitlines()[0]
        # The layout change is proven by the record: the segment that saved ran at TP/PP 2, the one
        # that resumed at DP 2, and the run's change log says so.
        resumed_layout, dim = layout(tmp_path / saved_at), key.removeprefix("parallel.")
        assert (saved_layout[dim], resumed_layout[dim], resumed_layout["dp"]) == (int(value), 1, 2), saved_at
        changes = [json.loads(line) for line in (tmp_path / saved_at / "config-changes.jsonl").read_text().splitlines()]
        want_changes = {key: [int(value), 1]} | {extra.split("=")[0]: [True, False] for extra in also}
        assert [c["changes"] for c in changes] == [want_changes], saved_at
        a, b = read_metrics(straight), read_metrics(tmp_path / saved_at)
        assert last_by_step(b, "data/hash") == last_by_step(a, "data/hash"), saved_at
        want, got = last_by_step(a, "val/loss"), last_by_step(b, "val/loss")
        assert sorted(got) == sorted(want), saved_at
        # Only bounded above: whether TP/PP and DP round a loss differently is the CPU kernels' business
        # (on some machines every val loss comes out bit-identical).
        drift = max(abs(got[s] - want[s]) for s in got)
        assert drift < 1e-4, (saved_at, drift)


def layout(run_dir: Path) -> dict:
    """The layout the run's latest segment trained at, as its manifest records it."""
    return json.loads((run_dir / "manifest.json").read_text())["layout"]


@pytest.fixture(scope="module")
def linear_run(tmp_path_factory, sample_dataset) -> Path:
    """The linear arm, one rank, a shorter run (past cpu-xs warm-up) than `uninterrupted`'s: once for
    both engines' runs, which must see the same stream."""
    run_dir = tmp_path_factory.mktemp("train") / "linear"
    run_to_end(train_args(run_dir, sample_dataset, "linear", "train.steps=11"), 1)
    return run_dir


@pytest.mark.slow
def test_two_arms_see_identical_batches(uninterrupted, linear_run):
    _, uninterrupted = uninterrupted
    linear = last_by_step(read_metrics(linear_run), "data/hash")
    nonlinear = last_by_step(read_metrics(uninterrupted), "data/hash")
    assert linear == {s: nonlinear[s] for s in linear} and len(linear) == 11


@pytest.mark.slow
def test_truncated_latest_checkpoint_falls_back_to_previous(sample_dataset, tmp_path):
    run_dir = tmp_path / "trunc"
    args = train_args(run_dir, sample_dataset, "linear", "train.steps=12", "checkpoint.every=6")
    run_to_end(args, 1)
    shard = max((run_dir / "checkpoints" / "step_12").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    mark_killed(run_dir)
    out = run_to_end(args, 1)
    assert "skipping checkpoint" in out and "truncated" in out and "resuming from" in out
    assert "step_6" in out.split("resuming from", 1)[1].splitlines()[0]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 12


@pytest.mark.slow
def test_nan_loss_marks_the_run_diverged_and_keeps_the_last_good_checkpoint(sample_dataset, tmp_path):
    run_dir = tmp_path / "nan"
    nan_at_step_5 = (str(SCRIPTS / "train_nan_at.py"), "5")  # tests/faults.py: no hook in production
    proc = start(train_args(run_dir, sample_dataset, "nonlinear", "checkpoint.every=2"), 1, nan_at_step_5)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "diverged" and "non-finite" in status["error"] and status["step"] == 5
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_4"
    events = [r for r in read_metrics(run_dir) if r.get("event") == "diverged"]
    assert events and events[0]["step"] == 5


def test_run_dir_holding_another_config_is_refused_untouched(sample_dataset, tmp_path):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 1\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    r = nlq(*train_args(run_dir, sample_dataset))
    assert r.returncode == 2 and "different config" in r.stderr and r.stderr.count("\n") == 1
    assert (run_dir / "config.yaml").read_text() == "seed: 1\n"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize(
    "extra, message",
    [
        (["train.lr=-1"], "train.lr"),
        (["model.bogus=1"], "model.bogus: unknown key"),
        (["data.path=/nonexistent/data"], "/nonexistent/data"),
        (["train.global_batch_size=6"], "global_batch_size"),
    ],
)
def test_bad_train_input_exits_2_and_writes_nothing(sample_dataset, tmp_path, extra, message):
    run_dir = tmp_path / "never"
    r = nlq(*train_args(run_dir, sample_dataset), *extra)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_moe_with_expert_parallelism_trains_across_two_ranks(sample_dataset, tmp_path):
    run_dir = tmp_path / "moe-ep2"
    moe = ["train.steps=12", "model.moe.num_experts=4", "parallel.ep=2"]
    run_to_end(train_args(run_dir, sample_dataset, "nonlinear", *moe), 2)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 12
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["layout"]["ep"], manifest["layout"]["dp"]) == (2, 2)
    losses = last_by_step(read_metrics(run_dir), "train/loss")
    assert losses[12] < losses[1]


def test_validation_stderr_and_micro_batches():
    """reduce_eval's standard error is the sample standard deviation of the per-sequence losses over
    sqrt(n); eval_micro_batch picks the largest micro-batch up to the training one dividing a share."""
    import numpy as np

    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.runtime.device import Device
    from nlq_scale.runtime.dist import distributed
    from nlq_scale.train.engine_common import eval_micro_batch, reduce_eval

    x = torch.from_numpy(np.random.default_rng(0).normal(3.0, 0.4, 12))
    losses = [{"lm loss": part.mean(), "sequence losses": part} for part in x.split(4)]
    with distributed(ParallelConfig()):
        stats = reduce_eval(losses, Device(torch.device("cpu")))
    assert stats.loss == pytest.approx(float(x.mean()), rel=1e-12)
    assert stats.stderr == pytest.approx(float(np.std(x.numpy(), ddof=1) / np.sqrt(12)), rel=1e-12)
    assert [eval_micro_batch(rows, 12) for rows in (1024, 15, 7, 12, 5)] == [8, 5, 7, 12, 5]
    assert eval_micro_batch(7, 4) == 1
