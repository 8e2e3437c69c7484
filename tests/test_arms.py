"""The conformance suite: every registered arm, with the norm and QK-norm variants, against the
plain-PyTorch reference, its own accounting, the planner, checkpoints and parallel layouts.

An arm registered through $NLQ_SCALE_ARMS runs through the same suite (test_example_arm_conforms
does so for the docs/arms.md example), so a new arm that gets a piece wrong fails here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nlq_scale import arms
from nlq_scale.arms.base import Arm
from nlq_scale.config import load_run_config
from nlq_scale.errors import UsageError
from nlq_scale.model.accounting import count_parameters
from tests.conftest import REPO, TINY_MODEL, run_ranks
from tests.test_model import build_model as build

VARIANTS = {
    "stock": [],
    "nobias-rmsqk": ["model.norm_bias=false", "model.qk_norm=rms"],
    "learnedqk-rope-gqa": ["model.qk_norm=learned", "model.position_embedding=rope", "model.num_query_groups=2"],
    # muP at width multiplier 4 with the head dim twice the base's: init, logit and attention multipliers.
    "mup": ["model.parametrization=mup", "model.mup_base_hidden_size=16", "model.mup_base_head_dim=8"],
}
# Further shapes and the control arms' config files (configs/arms/<name>.yaml).
MORE = [
    ("identity", ["model.num_query_groups=1", "model.normalization=RMSNorm"]),
    ("nonlinear", ["model.nlq.activation=relu2", "model.nlq.width=24", "model.add_bias_linear=true"]),
    ("nonlinear", ["model.nlq.fuse_up=true", "model.add_bias_linear=true", "model.num_query_groups=2"]),
    ("nonlinear-ph", ["model.nlq_ph.fuse_up=true", "model.position_embedding=rope"]),
    ("residual", ["model.add_bias_linear=true", "model.tie_embeddings=false"]),
    ("linear", ["model.tie_embeddings=false", "model.position_embedding=rope", "model.num_query_groups=2"]),
    ("linear-mlp4.75", []),
    ("linear-matched", []),
]
CASES = [pytest.param(arm, VARIANTS[v], id=f"{arm}-{v}") for arm in arms.names() for v in VARIANTS] + [
    pytest.param(arm, overrides, id=f"{arm}-more{i}") for i, (arm, overrides) in enumerate(MORE)
]
# cpu-xs with a small vocabulary and 4 wider layers: the layers, not the logits, hold the activations.
LAYER_BOUND = ["model.vocab_size=256", "model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=4"]
NOT_ARMS = ("lr_schedule", "loss_space", "loss-space", "LOSS_SPACES")
EXAMPLE_ARM = REPO / "docs" / "examples" / "gain_arm.py"


def case_config(arm: str, overrides: list[str] | tuple = ()):
    """The 124m scale at TINY_MODEL's shape with an arm (a registered arm or a configs/arms name)."""
    if arm in arms.names():
        return load_run_config("124m", overrides=[*TINY_MODEL, f"model.arm={arm}", *overrides])
    return load_run_config("124m", arm, overrides=[*TINY_MODEL, *overrides])


def logits(model, cfg, tokens):
    positions = torch.arange(cfg.model.seq_length).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        return model(tokens, positions, None)


def tokens_for(cfg, batch: int = 3, seed: int = 1):
    return torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_length), generator=torch.Generator().manual_seed(seed))


def _loss(model, cfg, tokens) -> torch.Tensor:
    positions = torch.arange(cfg.model.seq_length).unsqueeze(0).expand(tokens.shape[0], -1)
    return model(tokens, positions, None, labels=tokens).mean()


# ---------------------------------------------------------------- the registry


def test_registry_refuses_an_arm_missing_a_piece():
    class Incomplete(Arm):
        name = "incomplete"
        summary = "q = ?"
        fused_qkv = False

        def softmax_scale(self, m):
            return 1.0

        def query_params(self, m):
            return {}

    with pytest.raises(TypeError, match="activation_elements.*megatron_attention.*reference_query.*weight_names"):
        arms.register(Incomplete)

    class HalfDeclared(type(arms.get("identity"))):
        name = "half"
        options_key = "half"  # an option section without its model

    with pytest.raises(TypeError, match="set both `options` and `options_key`"):
        arms.register(HalfDeclared)
    assert not {"incomplete", "half"} & set(arms.names())


def test_exactly_one_baseline_and_it_is_the_default_arm():
    from nlq_scale.config.schema import ModelConfig

    assert sum(a.baseline for a in arms.all_arms()) == 1
    assert ModelConfig().arm == arms.baseline().name


def test_no_arm_is_named_outside_its_own_module():
    """Only an arm's module (and the registry's list of shipped modules) spells its name in quotes."""
    package = REPO / "nlq_scale"
    quoted = re.compile(r"""["'](%s)["']""" % "|".join(map(re.escape, arms.names())))
    found = []
    for path in package.rglob("*.py"):
        if path.parent == package / "arms":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            # "linear" is also a learning-rate schedule and a fit's loss space, neither an arm.
            if quoted.search(line) and not any(word in line for word in NOT_ARMS):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_renamed_and_retyped_keys_migrate():
    from nlq_scale.errors import UsageError

    with pytest.raises(UsageError, match=r"^config: model\.nlq: `rank` was renamed: use model\.nlq\.width$"):
        case_config("nonlinear", ["model.nlq.rank=8"])
    with pytest.raises(UsageError, match=r"model\.preproj\.width"):
        case_config("preproj", ["model.preproj.rank=8"])
    assert case_config("nonlinear", ["model.nlq.rank=null"]).model.nlq.width is None  # saved configs load
    assert case_config("linear", ["model.qk_norm=true"]).model.qk_norm == "learned"
    assert case_config("linear", ["model.qk_norm=false"]).model.qk_norm == "none"


# ---------------------------------------------------------------- conformance, per arm and variant


@pytest.mark.parametrize("arm, overrides", CASES)
def test_logits_equal_the_reference(single_rank, arm, overrides):
    from nlq_scale.model.reference import ReferenceGPT, load_into_megatron

    cfg = case_config(arm, overrides)
    model = build(cfg)
    torch.manual_seed(0)
    ref = ReferenceGPT(cfg.model)
    load_into_megatron(model, ref)
    tokens = tokens_for(cfg)
    with torch.no_grad():
        theirs = ref(tokens)
    assert (logits(model, cfg, tokens) - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arm, overrides", CASES)
def test_accounting_and_weight_names_match_the_built_models(single_rank, arm, overrides):
    from nlq_scale.model.reference import ReferenceGPT

    cfg = case_config(arm, overrides)
    m = cfg.model
    a = arms.get(m.arm)
    model, ref = build(cfg), ReferenceGPT(cfg.model)
    counted = count_parameters(m)
    assert sum(p.numel() for p in model.parameters()) == counted.total
    assert sum(p.numel() for p in ref.parameters()) == counted.total

    names = a.weight_names(m)
    attention = dict(ref.blocks[0].attn.named_parameters())
    query_path = {k: p for k, p in attention.items() if k.startswith("query.")}
    assert sorted(w.reference for w in names) == sorted(query_path), "weight_names must list the query path"
    assert sum(p.numel() for p in query_path.values()) == sum(a.query_params(m).values())
    assert {w.reference: w.matrix for w in names} == {k: p.dim() >= 2 for k, p in query_path.items()}
    assert len({w.export for w in names}) == len(names)
    layer = {k.removeprefix("decoder.layers.0."): p for k, p in model.named_parameters() if k.startswith("decoder.layers.0.")}
    assert {w.megatron for w in names} <= set(layer)


@pytest.mark.parametrize("arm, overrides", CASES)
def test_every_parameter_has_a_mup_class_and_declared_matrices_are_hidden(single_rank, arm, overrides):
    from nlq_scale.model import mup

    m = case_config(arm, overrides).model
    classes = {n: mup.param_class(m, n, p.dim()) for n, p in build(case_config(arm, overrides)).named_parameters()}
    for w in arms.get(m.arm).weight_names(m):
        assert classes[f"decoder.layers.0.{w.megatron}"] == ("hidden" if w.matrix else "vector"), w
    assert classes["embedding.word_embeddings.weight"] == "embedding"
    assert classes["decoder.layers.1.mlp.linear_fc2.weight"] == "hidden"
    assert classes["decoder.final_layernorm.weight"] == "vector"


@pytest.mark.parametrize("arm", arms.names())
def test_mup_init_scales_exactly_the_hidden_matrices(single_rank, arm):
    """megatron's muP inits the matrices of its config.init_method at std / sqrt(w): every matrix an
    arm declares must be one of them or scale its own init alike (preproj's W_skip). The standard
    parametrization's draw, hidden matrices x 1/sqrt(w), everything else unchanged."""
    from nlq_scale.model import mup

    cfg = case_config(arm, VARIANTS["mup"])
    standard = dict(build(case_config(arm)).named_parameters())
    factor = mup.width_multiplier(cfg.model) ** -0.5
    for name, p in build(cfg).named_parameters():
        expected = standard[name] * (factor if mup.param_class(cfg.model, name, p.dim()) == "hidden" else 1.0)
        torch.testing.assert_close(p, expected, rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("arm", arms.names())
def test_planner_activation_memory_within_15_percent_of_measured(arm):
    """Method: nlq_scale/model/memory.py (torch.profiler's allocator events over a forward + backward of
    the reference model, fp32, selective recompute since SDPA keeps no s^2). The shape keeps the
    layers' activations ~10x the logits', so an arm's own term (nonlinear: ~15%) is visible."""
    from nlq_scale.cluster.plan import memory_per_device, one_device_layout
    from nlq_scale.model.memory import measure

    cfg = load_run_config("cpu-xs", overrides=[f"model.arm={arm}", "parallel.recompute=selective", *LAYER_BOUND])
    _, peak = measure(cfg)
    assert memory_per_device(cfg, one_device_layout(cfg)).activations == pytest.approx(peak, rel=0.15)


def _recomputes(arm: str) -> bool:
    return arms.get(arm).recomputes_query(case_config(arm).model, True)


def _saved_for_backward(forward) -> tuple[torch.Tensor, int]:
    """forward()'s output and the bytes of the distinct storages autograd saved for its backward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, sum(storages.values())


@pytest.mark.parametrize("arm", arms.names())
def test_query_recompute_keeps_loss_and_gradients_bit_for_bit(single_rank, arm):
    """parallel.recompute_query runs the same ops again in backward: the megatron model's loss and
    every gradient are unchanged, and the reference model's too; the megatron model saves less for
    backward exactly for the arms with a query MLP."""
    from nlq_scale.model.gpt import transformer_config
    from nlq_scale.model.reference import ReferenceGPT

    grads, saved = [], []
    for recompute in (False, True):
        cfg = case_config(arm, [f"parallel.recompute_query={recompute}"])
        assert transformer_config(cfg.model, cfg.parallel).recompute_query == (recompute and _recomputes(arm))
        model, tokens = build(cfg), tokens_for(cfg)
        loss, nbytes = _saved_for_backward(lambda: _loss(model, cfg, tokens))
        loss.backward()
        torch.manual_seed(0)
        ref = ReferenceGPT(cfg.model, recompute)
        ref(tokens, tokens).mean().backward()
        grads.append([p.grad for p in (*model.parameters(), *ref.parameters())])
        saved.append(nbytes)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert (saved[1] < saved[0]) if _recomputes(arm) else (saved[1] == saved[0]), saved


@pytest.mark.parametrize("arm", [a for a in arms.names() if _recomputes(a)])
def test_query_recompute_frees_the_query_activations_as_the_planner_says(arm):
    """With parallel.recompute_query the measured peak drops below the arm's own, and the planner's
    estimate (what Arm.recomputed_activation_elements keeps + one layer's recomputation) stays within
    15% of it."""
    from nlq_scale.cluster.plan import memory_per_device, one_device_layout
    from nlq_scale.model.memory import measure

    peaks = {}
    for recompute in (False, True):
        cfg = load_run_config("cpu-xs", overrides=[f"model.arm={arm}", "parallel.recompute=selective",
                                                   f"parallel.recompute_query={recompute}", *LAYER_BOUND])
        _, peaks[recompute] = measure(cfg)
    assert peaks[True] < peaks[False]
    assert memory_per_device(cfg, one_device_layout(cfg)).activations == pytest.approx(peaks[True], rel=0.15)


@pytest.mark.parametrize("arm, bias", [("nonlinear", False), ("nonlinear", True), ("nonlinear-ph", True)])
def test_fused_up_gives_the_unfused_loss_and_gradients_and_keeps_less(single_rank, arm, bias):
    """fuse_up (model.nlq, model.nlq_ph) on the same parameters: loss and every gradient as unfused (with and without
    parallel.recompute_query), and autograd keeps at least the (d - r) fewer elements per token and
    layer that the planner's accounting counts."""
    grads, saved, per_layer = {}, {}, {}
    for fused in (False, True):
        for recompute in (False, True):
            cfg = case_config(arm, [f"model.{arms.get(arm).options_key}.fuse_up={fused}", f"parallel.recompute_query={recompute}",
                                            f"model.add_bias_linear={bias}"])
            model, tokens = build(cfg), tokens_for(cfg)
            loss, saved[fused, recompute] = _saved_for_backward(lambda: _loss(model, cfg, tokens))
            loss.backward()
            grads[fused, recompute] = [loss.detach(), *(p.grad for p in model.parameters())]
            kept = arms.get(arm).recomputed_activation_elements if recompute else arms.get(arm).activation_elements
            per_layer[fused, recompute] = sum(kept(cfg.model, tokens.numel()))
    for key in grads:
        for a, b in zip(grads[False, False], grads[key], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    m = cfg.model
    planned = (per_layer[False, False] - per_layer[True, False]) * m.num_layers * 4
    assert planned == tokens.numel() * m.num_layers * 4 * (m.hidden_size - m.hidden_size // 2)
    # torch's CPU RMSNorm also keeps x/rms(x) before the gain: the planner's figure is a lower bound
    assert saved[False, False] - saved[True, False] >= planned
    assert saved[False, True] == saved[True, True] and per_layer[False, True] == per_layer[True, True]


def _loss_and_gradients(cfg) -> list[torch.Tensor]:
    model = build(cfg)
    loss = _loss(model, cfg, tokens_for(cfg))
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.slow  # inductor writes and builds C++ kernels on the CPU: ~25 s
def test_compiled_query_gives_the_eager_loss_and_gradients(single_rank):
    """parallel.compile_query on the arms with a query MLP (with fuse_up and recompute_query too):
    the eager loss and every gradient on the same parameters, from graphs dynamo really compiled."""
    from torch._dynamo.utils import counters  # private: the only record of what dynamo compiled

    cases = [("nonlinear", ["model.add_bias_linear=true"]), ("nonlinear", ["model.nlq.fuse_up=true", "parallel.recompute_query=true"]),
             ("nonlinear-ph", []), ("preproj", [])]  # fmt: skip
    torch._dynamo.reset()
    for arm, overrides in cases:
        eager, fused = (_loss_and_gradients(case_config(arm, [*overrides, f"parallel.compile_query={c}"])) for c in (False, True))
        for a, b in zip(eager, fused, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 3  # rms_norm, mixed_layer_norm, per_head_query


@pytest.mark.parametrize("arm", arms.names())
def test_checkpoint_round_trip_gives_identical_logits(single_rank, arm, tmp_path):
    from megatron.core import dist_checkpointing

    cfg = case_config(arm, VARIANTS["nobias-rmsqk"])
    saved = build(cfg)
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path))
    loaded = build(cfg, seed=99)
    tokens = tokens_for(cfg)
    assert not torch.equal(logits(loaded, cfg, tokens), logits(saved, cfg, tokens))
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), str(tmp_path)))
    assert torch.equal(logits(loaded, cfg, tokens), logits(saved, cfg, tokens))


def exported_loss(checkpoint: Path, case: str) -> float:
    """The loss on layout_loss.py's tokens of its checkpoint as `nlq-scale export` reads (into one
    TP=1 model) and converts it (to transformers, a stock class where one fits)."""
    import torch.nn.functional as F

    from nlq_scale.export.checkpoint import Checkpoint, load_harness_model
    from nlq_scale.export.hf import hf_model

    arm, *extra = case.split("|")
    cfg = case_config(arm, extra)
    model = load_harness_model(Checkpoint(run_dir=checkpoint, path=checkpoint, step=0, cfg=cfg))
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_length + 1))
    with torch.no_grad():
        out = hf_model(model.state_dict(), cfg.model)(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten()).item()


# Fused RMSNorm cases, each with its unfused twin: at every layout the same gradients.
FUSED_TWINS = {
    "nonlinear|model.nlq.fuse_up=true|model.add_bias_linear=true|model.num_query_groups=2":
        "nonlinear|model.add_bias_linear=true|model.num_query_groups=2",
    "nonlinear-ph|model.nlq_ph.fuse_up=true": "nonlinear-ph",
}


@pytest.mark.slow
def test_tp2_and_pp2_give_the_tp1_loss_and_export_to_it(single_rank, tmp_path):
    """Reference weights through megatron's pipeline schedule at TP=2 (with and without sequence
    parallelism) and PP=2 vs TP=1, for every arm (SDPA core attention), two variants and megatron's own
    core attention (TP=1 equals the reference by test_logits_equal_the_reference); and each layout's
    checkpoint, exported, gives its loss. A fused
    RMSNorm (fuse_up) gives its unfused twin's gradients on every rank of every layout."""
    cases = [*arms.names()] + [
        "|".join([arm, *VARIANTS[variant]]) for arm, variant in (("nonlinear", "nobias-rmsqk"), ("identity", "learnedqk-rope-gqa"))
    ] + [case for pair in FUSED_TWINS.items() for case in pair if case not in arms.names()] + [
        "linear|model.core_attention=stock", "nonlinear|model.core_attention=stock|model.num_query_groups=2"]  # fmt: skip
    for tp, pp, sp in ((1, 1, "-"), (2, 1, "-"), (2, 1, "sp"), (1, 2, "-")):
        out = tmp_path / f"{tp}x{pp}{sp}.json"
        run_ranks("layout_loss.py", tp * pp, str(tp), str(pp), sp, str(out), *cases)
    losses = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    for layout in losses:
        for fused, unfused in FUSED_TWINS.items():
            for grads in (tmp_path / f"{layout}.grads" / str(cases.index(fused))).glob("*.pt"):
                twin = torch.load(tmp_path / f"{layout}.grads" / str(cases.index(unfused)) / grads.name)
                for name, grad in torch.load(grads).items():
                    torch.testing.assert_close(grad, twin[name], rtol=1e-4, atol=1e-7, msg=f"{layout} {fused} {name}")
    base = losses.pop("1x1-")
    for layout, per_case in losses.items():
        for case in cases:
            assert abs(per_case[case] - base[case]) <= 1e-5 * base[case], (layout, case, per_case[case], base[case])
            exported = exported_loss(tmp_path / f"{layout}.ckpt" / str(cases.index(case)), case)
            assert abs(exported - per_case[case]) <= 1e-5 * base[case], (layout, case, exported, per_case[case])


def test_example_arm_conforms():
    """docs/arms.md's example arm, registered from outside the package, passes the fast suite."""
    assert EXAMPLE_ARM.read_text() in (REPO / "docs" / "arms.md").read_text(), "docs/arms.md shows the example file"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-m", "not slow", "-k", "gain"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=os.environ | {"NLQ_SCALE_ARMS": str(EXAMPLE_ARM)},
    )
    assert r.returncode == 0, r.stdout[-3000:]
    passed = int(re.search(r"(\d+) passed", r.stdout).group(1))
    assert passed >= 2 * len(VARIANTS) + 2, r.stdout[-1000:]


def _two_micro_batches(cfg) -> list[torch.Tensor]:
    """Losses of two micro-batches (different tokens, one backward each, as megatron runs them), then
    every accumulated gradient, and the logits of a call without autograd."""
    model = build(cfg)
    losses = []
    for seed in (1, 2):
        loss = _loss(model, cfg, tokens_for(cfg, seed=seed))
        loss.backward()
        losses.append(loss.detach())
    return [*losses, *(p.grad for p in model.parameters()), logits(model, cfg, tokens_for(cfg))]


@pytest.mark.parametrize("arm, overrides", [("nonlinear", ["model.nlq.fuse_up=true"]), ("nonlinear-ph", []),
                                            ("residual", ["model.add_bias_linear=true"]), ("identity", [])])  # fmt: skip
def test_graphed_query_gives_the_eager_losses_and_gradients(single_rank, arm, overrides):
    """parallel.graph_query on the CPU: the static buffers and the autograd function around the
    (eagerly re-run) graphs give the eager losses and gradients over two micro-batches, each
    captured layer reused by the second; without autograd the module itself runs."""
    from nlq_scale.model.graphed import GraphedQuery

    eager, graphed = (_two_micro_batches(case_config(arm, [*overrides, f"parallel.graph_query={g}"])) for g in (False, True))
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    model = build(case_config(arm, ["parallel.graph_query=true"]))
    layers = [m for m in model.modules() if getattr(m, "graphed_query", None) is not None]
    assert len(layers) == model.config.num_layers and all(isinstance(m.graphed_query, GraphedQuery) for m in layers)
    assert not any("graphed" in name for name in model.state_dict())


@pytest.mark.parametrize("refused, field", [("parallel.tp=2", "parallel.tp > 1"), ("parallel.pp=2", "parallel.pp > 1"),
                                            ("parallel.recompute=full", "parallel.recompute=full"),
                                            ("parallel.recompute_query=true", "parallel.recompute_query"),
                                            ("train.engine=deepspeed", "train.engine=deepspeed")])  # fmt: skip
def test_graphed_query_refuses_what_it_cannot_replay(refused, field):
    with pytest.raises(UsageError, match=re.escape(f"parallel.graph_query: unsupported with {field}")):
        case_config("nonlinear", ["parallel.graph_query=true", refused])
