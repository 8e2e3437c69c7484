"""muP (model.parametrization=mup): the multipliers reach both engines' optimizer steps, init is
scaled per class, the standard parametrization is untouched, and both engines train alike under it.
The per-arm classes and the logit/attention multipliers run in the conformance suite (test_arms.py)."""

from __future__ import annotations

import pytest
import torch

from nlq_scale.model import mup
from tests.test_train_deepspeed import script

WIDTH_4 = ["model.parametrization=mup", "model.mup_base_hidden_size=16"]  # cpu-xs is d 64: w = 4
ONE_CLEAN_STEP = ["train.grad_clip=0", "train.weight_decay=0", "train.eps=1e-15", "train.warmup_steps=0", "train.min_lr_ratio=1"]
ENGINES = ["megatron", "deepspeed"]


def engine_for(name: str, cfg):
    s = script()
    return s.megatron_engine(cfg) if name == "megatron" else s.deepspeed_engine(cfg)


def module_of(engine) -> torch.nn.Module:
    return engine.model if hasattr(engine, "model") else engine.engine.module


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module_of(engine).named_parameters()}


@pytest.mark.parametrize("engine_name", ENGINES)
def test_multipliers_reach_the_optimizer_step(single_rank, engine_name):
    """Adam's first step moves every coordinate by its group's lr (g / |g|): lr / w for hidden
    matrices, lr for vectors and embeddings."""
    s = script()
    cfg = s.config([*WIDTH_4, *ONE_CLEAN_STEP, "train.zero_stage=1"])
    engine = engine_for(engine_name, cfg)
    before = snapshot(engine)
    s.train(engine, cfg, s.batches(cfg, 1, seed=0), 0)
    lr, w = cfg.train.lr, mup.width_multiplier(cfg.model)
    seen = set()
    for name, p in module_of(engine).named_parameters():
        cls = mup.param_class(cfg.model, name, p.dim())
        step = (p.detach().float() - before[name]).abs().max().item()
        assert step == pytest.approx(lr / w if cls == "hidden" else lr, rel=1e-3), (name, cls)
        seen.add(cls)
    assert seen == {"hidden", "vector", "embedding"}
    groups = engine.optimizer.param_groups if engine_name == "megatron" else engine.engine.optimizer.param_groups
    hidden = [g for g in groups if g.get("lr_mult", 1.0) != 1.0 and g["params"]]
    assert hidden and all(g["eps"] == pytest.approx(cfg.train.eps / w) for g in hidden)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_decay_of_hidden_matrices_does_not_shrink_with_their_lr(single_rank, engine_name):
    s = script()
    cfg = s.config([*WIDTH_4, "train.weight_decay=0.1", "train.zero_stage=1"])
    engine = engine_for(engine_name, cfg)
    engine.set_lr(1e-3)
    groups = engine.optimizer.param_groups if engine_name == "megatron" else engine.engine.optimizer.param_groups
    products = {round(g["lr"] * g["weight_decay"], 12) for g in groups if g["params"] and g["weight_decay"]}
    assert products == {1e-4}


def test_hidden_init_is_scaled_and_embeddings_are_not(single_rank):
    s = script()
    std = {}
    for parametrization in (["model.parametrization=standard"], WIDTH_4):
        engine = s.megatron_engine(s.config([*parametrization, "model.init_std=0.02"]))
        std[parametrization[0]] = {n: p.detach().std().item() for n, p in engine.model.named_parameters()}
    standard, scaled = std["model.parametrization=standard"], std[WIDTH_4[0]]
    qkv = "module.decoder.layers.0.self_attention.linear_kv.weight"
    assert scaled[qkv] == pytest.approx(standard[qkv] / 2, rel=1e-6)  # std / sqrt(4), same draw
    emb = "module.embedding.word_embeddings.weight"
    assert scaled[emb] == standard[emb]


@pytest.mark.parametrize("engine_name", ENGINES)
def test_mup_at_the_base_width_trains_as_standard(single_rank, engine_name):
    """Every multiplier is 1 at w = 1; only the parameter grouping differs, which may change the
    order of float sums (the hidden matrices sit in a group of their own): the same curve to rounding."""
    s = script()
    curves = []
    for extra in ([], ["model.parametrization=mup", "model.mup_base_hidden_size=64"]):
        cfg = s.config([*extra, "train.steps=4", "train.zero_stage=1"])
        curves.append(s.train(engine_for(engine_name, cfg), cfg, s.batches(cfg, 4, seed=0), 0))
    assert curves[0] == pytest.approx(curves[1], rel=1e-6)


def test_engines_agree_under_mup(single_rank):
    s = script()
    cfg = s.config([*WIDTH_4, "train.zero_stage=1", "train.steps=6", "train.grad_clip=0.3", "train.weight_decay=0.1"])
    out = s.compare(cfg, None)
    for step, (ours, theirs) in enumerate(zip(out["deepspeed"], out["megatron"], strict=True)):
        assert abs(ours - theirs) <= 1e-6 * theirs, (step, ours, theirs)


def test_mup_needs_its_base_width():
    from nlq_scale.config import load_run_config
    from nlq_scale.errors import UsageError

    with pytest.raises(UsageError, match="mup_base_hidden_size"):
        load_run_config("cpu-xs", "nonlinear", overrides=["model.parametrization=mup"])
