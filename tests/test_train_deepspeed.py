"""The DeepSpeed engine on random tokens (tests/scripts/deepspeed_engine.py): the megatron engine's
loss curve, ZeRO stages that agree, bit-exact save/resume, and resume at another data- or
tensor-parallel size through universal-checkpoint conversion."""

from __future__ import annotations

import gc
import json
import math
import weakref

import pytest

from tests.conftest import run_ranks
from tests.faults import nan_loss


def script():
    from tests.scripts import deepspeed_engine

    return deepspeed_engine


def run(tmp_path, mode: str, nproc: int, *overrides: str) -> dict:
    """`mode` of the rank script at `nproc` processes; its checkpoint dir is tmp_path/ckpt."""
    out = tmp_path / f"{mode}-{nproc}.json"
    run_ranks("deepspeed_engine.py", nproc, mode, str(out), "--dir", str(tmp_path / "ckpt"), *overrides)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.zero_stage=0"],
        ["train.zero_stage=1"],
        ["train.zero_stage=1", "model.moe.num_experts=4", "train.steps=8"],
    ],
    ids=["zero0", "zero1", "zero1-moe"],
)
def test_loss_curve_matches_megatron_engine(single_rank, overrides):
    """Same seed, same batches, clipping active, z-loss on: the whole curve within float noise."""
    s = script()
    cfg = s.config(overrides + ["train.grad_clip=0.3", "train.z_loss=1e-4"])
    out = s.compare(cfg, None)
    assert math.isclose(out["deepspeed_val"], out["megatron_val"], rel_tol=1e-6)
    for step, (ours, theirs) in enumerate(zip(out["deepspeed"], out["megatron"], strict=True)):
        assert abs(ours - theirs) <= 1e-6 * theirs, (step, ours, theirs)


@pytest.mark.parametrize("clip, exact", [("0", True), ("0.3", False)], ids=["no-clip", "clip"])
def test_zero_stages_agree(single_rank, clip, exact):
    """ZeRO-1/2 equal ZeRO-0 bit for bit unless clipping is active (each stage sums the grad norm in
    its own order); ZeRO-3 (its own reduction order) within float noise."""
    s = script()
    curves = {}
    for stage in range(4):
        cfg = s.config([f"train.zero_stage={stage}", f"train.grad_clip={clip}", "train.steps=6"])
        engine = s.deepspeed_engine(cfg)
        curves[stage] = s.train(engine, cfg, s.batches(cfg, 6, seed=0), 0)
        engine.close()
    for stage in (1, 2, 3):
        if exact and stage < 3:
            # Must hold on any CPU: one rank reduces nothing, and Adam's update is elementwise, the same
            # IEEE operations on each element whether it sits in its own tensor or a flat partition.
            assert curves[stage] == curves[0], stage
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(curves[stage], curves[0], strict=True)), stage


@pytest.mark.parametrize(
    "overrides",
    [["train.zero_stage=0"], ["train.zero_stage=1"], ["train.zero_stage=2"], ["train.zero_stage=3"],
     ["train.zero_stage=1", "model.bf16=true"], ["train.zero_stage=0", "model.bf16=true"]],
    ids=["zero0", "zero1", "zero2", "zero3", "zero1-bf16", "zero0-bf16"],
)
def test_resume_is_bit_exact(single_rank, tmp_path, overrides):
    s = script()
    out = s.resume(s.config(overrides), tmp_path / "ckpt")
    assert out["resumed"] == out["uninterrupted"]


def test_poisoned_step_reports_nan(single_rank):
    s = script()
    cfg = s.config(["train.zero_stage=1"])
    engine = s.deepspeed_engine(cfg)
    clean, dirty = s.batches(cfg, 2, seed=0)
    assert math.isfinite(engine.train_step(clean).loss)
    with nan_loss():
        poisoned = engine.train_step(dirty)
    assert math.isnan(poisoned.loss) and not math.isfinite(poisoned.grad_norm)


def test_not_a_deepspeed_checkpoint_is_a_usage_error(single_rank, tmp_path):
    from nlq_scale.errors import UsageError

    s = script()
    engine = s.deepspeed_engine(s.config(["train.zero_stage=1"]))
    with pytest.raises(UsageError, match="deepspeed.json: missing"):
        engine.load(tmp_path)
    (tmp_path / "deepspeed.json").write_text('{"dp": 1}')
    with pytest.raises(UsageError, match="deepspeed.json: unreadable"):
        engine.load(tmp_path)


@pytest.mark.parametrize("engine_name", ["megatron", "deepspeed"])
def test_a_closed_engine_is_freed_with_its_model(single_rank, engine_name):
    """close() lets the model, and the process groups it holds, go with the engine's last
    reference (coord-check builds one engine per width in one process; each gloo group keeps a
    thread). Without it DDP's and DeepSpeed's gradient hooks kept every engine alive."""
    s = script()
    cfg = s.config(["train.zero_stage=1"])
    engine = getattr(s, f"{engine_name}_engine")(cfg)
    s.train(engine, cfg, s.batches(cfg, 1, seed=0), 0)
    model = weakref.ref(engine.model if engine_name == "megatron" else engine.engine.module)
    s.close_all()
    del engine
    gc.collect()
    assert model() is None


def test_which_shardings_load_without_conversion():
    from nlq_scale.train.engine_deepspeed import _Sharding

    zero1 = _Sharding(dp=2, tp=1, zero_stage=1, bf16=False)
    assert zero1.loads_plainly(zero1)
    assert not _Sharding(dp=1, tp=1, zero_stage=1, bf16=False).loads_plainly(zero1)
    assert not _Sharding(dp=2, tp=1, zero_stage=2, bf16=False).loads_plainly(zero1)
    zero0 = _Sharding(dp=2, tp=1, zero_stage=0, bf16=False)
    assert _Sharding(dp=1, tp=1, zero_stage=0, bf16=False).loads_plainly(zero0)  # replicated optimizer
    assert not _Sharding(dp=1, tp=2, zero_stage=0, bf16=False).loads_plainly(zero0)


def test_config_batch_arithmetic():
    from nlq_scale.train.engine_deepspeed import ds_config

    cfg = script().config(["train.zero_stage=2", "model.bf16=true"])
    c = ds_config(cfg, dp=2)
    assert c["train_batch_size"] == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * 2
    assert c["zero_optimization"]["stage"] == 2 and c["bf16"]["enabled"]
    assert c["optimizer"]["params"]["torch_adam"] is True


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_two_ranks_resume_is_bit_exact(tmp_path, stage):
    out = run(tmp_path, "resume", 2, f"train.zero_stage={stage}")
    assert out["resumed"] == out["uninterrupted"]


def assert_continues(saved: dict, loaded: dict) -> None:
    """The loaded state evaluates like the saved one and trains on like it, to rounding: another
    layout gives each rank other micro-batch shapes and thread counts, whose sums the CPU's kernels
    may order differently. A lost or misplaced optimizer state shows within 3 steps."""
    assert abs(loaded["val"] - saved["val"]) <= 1e-6 * saved["val"], (loaded, saved)
    for ours, theirs in zip(loaded["after"], saved["after"], strict=True):
        assert abs(ours - theirs) <= 1e-6 * theirs, (loaded, saved)


@pytest.mark.slow
@pytest.mark.parametrize(
    "save_nproc, load_nproc, stage",
    [(2, 1, 1), (2, 1, 3), (1, 2, 2), (2, 1, 0)],
    ids=["zero1-2to1", "zero3-2to1", "zero2-1to2", "zero0-2to1-plain"],
)
def test_resume_at_another_data_parallel_size(tmp_path, save_nproc, load_nproc, stage):
    saved = run(tmp_path, "save", save_nproc, f"train.zero_stage={stage}")
    loaded = run(tmp_path, "load", load_nproc, f"train.zero_stage={stage}")
    assert_continues(saved, loaded)
    assert not (tmp_path / "ckpt" / "universal.tmp").exists()


@pytest.mark.slow
def test_resume_at_another_tensor_parallel_size(tmp_path):
    saved = run(tmp_path, "save", 2, "train.zero_stage=1", "parallel.tp=2")
    loaded = run(tmp_path, "load", 1, "train.zero_stage=1", "parallel.tp=1")
    assert_continues(saved, loaded)
