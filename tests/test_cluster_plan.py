"""The resource planner: layouts for the anchors, memory model against bytes really allocated, cost."""

from __future__ import annotations

import json

import pytest
import yaml

from nlq_scale import arms
from nlq_scale.cluster.plan import GB, load_cluster, memory_per_device, one_device_layout, plan_run, plan_sweep
from nlq_scale.cluster.sweep import load_sweep, sweep_path
from nlq_scale.config.load import load_run_config
from nlq_scale.errors import UsageError
from nlq_scale.model.accounting import flops_per_token
from tests.conftest import nlq


def one_gpu_cluster(tmp_path, memory_gb=80):
    path = tmp_path / "one-gpu.yaml"
    path.write_text(yaml.safe_dump({"name": "one-gpu", "nodes": 1, "gpus_per_node": 1,
                                    "gpu_memory_gb": memory_gb, "peak_tflops": 312}))
    return load_cluster(str(path))


def plan(scale, cluster, *overrides, **kw):
    cfg = load_run_config(scale, "linear", None, list(overrides))
    return plan_run(cfg, cluster, run_id=f"{scale}-linear", scale=scale, arm="linear", **kw)


def test_124m_fits_one_80gb_gpu_with_data_parallelism_alone(tmp_path):
    single = plan("124m", one_gpu_cluster(tmp_path))
    assert single.fits and (single.layout.tp, single.layout.pp, single.layout.dp) == (1, 1, 1)
    assert single.memory.total < 80 * GB
    node = plan("124m", load_cluster("example-8x80gb"))
    assert (node.layout.tp, node.layout.pp, node.layout.dp, node.layout.nodes) == (1, 1, 8, 1)
    assert node.layout.micro_batch_size * node.layout.dp * node.layout.grad_accum == 480


MEGATRON_175B = ("model.bf16=true",)


@pytest.mark.parametrize("recompute", ["selective", "none"])
def test_175b_on_80gb_gpus_needs_tp8_and_pp_at_least_8(recompute):
    """Megatron's GPT-3 175B setting (bf16, sequence parallelism; Korthikanti et al. use selective)."""
    overrides = (*MEGATRON_175B, f"parallel.recompute={recompute}")
    p = plan("175b", load_cluster("example-8x80gb"), *overrides, sequence_parallel=True)
    assert p.fits and p.layout.sequence_parallel and p.layout.tp == 8 and p.layout.pp >= 8, p.as_dict()
    # and the next smaller pipeline would not fit: the planner does not over-split
    smaller = max(d for d in range(1, p.layout.pp) if 96 % d == 0)
    tight = plan("175b", load_cluster("example-8x80gb"), *overrides, fixed_tp=8, fixed_pp=smaller,
                 sequence_parallel=True)
    assert not tight.fits


def test_sequence_parallelism_only_where_the_config_allows_it():
    cluster = load_cluster("example-8x80gb")
    for arm in arms.names():
        run = plan_run(load_run_config("13b", arm), cluster, run_id="x", scale="13b", arm=arm, sequence_parallel=True)
        assert run.layout.tp > 1 and run.layout.sequence_parallel, arm
    cfg = load_run_config("13b", "nonlinear", overrides=["train.engine=deepspeed"])  # DeepSpeed refuses SP
    ds = plan_run(cfg, cluster, run_id="x", scale="13b", arm="nonlinear", sequence_parallel=True)
    assert ds.layout.tp > 1 and not ds.layout.sequence_parallel
    assert not plan("124m", cluster, sequence_parallel=True).layout.sequence_parallel  # tp = 1


def test_the_planner_turns_sequence_parallelism_on_where_a_layout_fits_only_with_it():
    """None (a sweep's default): off where the layout fits without it, on (before recompute_query
    and before halving the micro-batch) where it fits only with it; False never."""
    cluster = load_cluster("example-8x80gb")
    cfg = load_run_config("13b", "nonlinear")
    pinned = dict(fixed_tp=4, fixed_pp=1, fixed_micro_batch=True, recompute_query=False)
    without = plan_run(cfg, cluster, run_id="x", scale="13b", arm="nonlinear", sequence_parallel=False, **pinned)
    with_sp = plan_run(cfg, cluster, run_id="x", scale="13b", arm="nonlinear", sequence_parallel=True, **pinned)
    assert with_sp.memory.total < without.memory.total
    between = (with_sp.memory.total + without.memory.total) / 2
    sized = cluster.model_copy(update={"memory_headroom": 1.0, "overhead_gb": 0.0,
                                       "gpu_memory_gb": between / GB})  # fmt: skip
    chosen = plan_run(cfg, sized, run_id="x", scale="13b", arm="nonlinear", **pinned)
    assert chosen.fits and chosen.layout.sequence_parallel
    assert not plan_run(cfg, sized, run_id="x", scale="13b", arm="nonlinear", sequence_parallel=False, **pinned).fits
    roomy = plan_run(cfg, cluster, run_id="x", scale="13b", arm="nonlinear", fixed_tp=4, fixed_pp=1)
    assert roomy.fits and not roomy.layout.sequence_parallel


def test_175b_in_fp32_without_recompute_cannot_fit_any_pipeline_with_megatrons_attention():
    """The first stage keeps L layers of activations in flight whatever pp is (1F1B): ~72 GB here with
    megatron's unfused attention (its s x s probabilities kept), unless sequence parallelism splits them
    over TP (the planner turns it on), or SDPA (the default) keeps no probabilities."""
    cluster, fp32 = load_cluster("example-8x80gb"), ("model.bf16=false", "model.core_attention=stock")
    p = plan("175b", cluster, *fp32, sequence_parallel=False)
    assert not p.fits and p.memory.activations > 65 * GB and "needs" in p.reason
    assert plan("175b", cluster, *fp32).layout.sequence_parallel
    assert plan("175b", cluster, "model.bf16=false", sequence_parallel=False).fits


def test_gpu_scales_are_priced_in_bf16_and_learn_the_cluster_device():
    cluster = load_cluster("example-8x80gb")
    bf16, fp32 = plan("1.3b", cluster), plan("1.3b", cluster, "model.bf16=false")
    assert bf16.memory.params * 2 == fp32.memory.params  # 2-byte weights where fp32 has 4
    from nlq_scale.cluster.plan import apply_layout

    cfg = load_run_config(scale="124m", arm="linear")
    run = apply_layout(cfg, plan("124m", cluster).layout, "r", cluster)
    assert run.runtime.device == "cuda" and run.train.device_peak_flops == cluster.peak_tflops * 1e12
    assert apply_layout(cfg, plan("124m", cluster).layout, "r", load_cluster("local")).runtime.device == "cpu"


def test_recompute_and_sharding_shrink_what_they_should():
    cluster = load_cluster("example-8x80gb")
    at = dict(fixed_micro_batch=True)  # the config's micro-batch: otherwise each would plan its largest
    acts = [plan("1.3b", cluster, f"parallel.recompute={r}", "model.core_attention=stock", **at).memory.activations
            for r in ("none", "selective", "full")]  # fmt: skip
    assert acts[0] > acts[1] > acts[2]
    # SDPA's kernels (the default) keep no s x s probabilities: without recompute, what selective recompute keeps
    assert plan("1.3b", cluster, "parallel.recompute=none", **at).memory.activations == acts[1]
    zero = [plan("1.3b", cluster, "train.engine=deepspeed", f"train.zero_stage={z}").memory for z in (0, 1, 2, 3)]
    assert zero[0].optimizer == 8 * zero[1].optimizer  # Adam state split over dp = 8
    assert zero[1].grads == 8 * zero[2].grads and zero[2].params == 8 * zero[3].params
    dist = plan("1.3b", cluster).memory
    plain = plan("1.3b", cluster, "train.distributed_optimizer=false").memory
    assert plain.optimizer == 8 * dist.optimizer and plain.params == dist.params


def test_a_run_that_cannot_fit_is_a_usage_error_naming_it(tmp_path):
    sweep = {"name": "big", "scales": ["175b"], "arms": ["nonlinear"], "data": {"path": "/d"}, "cluster": "local-slurm"}
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(sweep))
    with pytest.raises(UsageError, match=r"run 175b-nonlinear-s1234-lr6e-05 cannot fit cluster local-slurm: needs"):
        plan_sweep(load_sweep(path), load_cluster("local-slurm"))
    out = nlq("plan", str(path))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "cannot fit" in out.stderr


def test_plan_cli_reports_layout_memory_cost_and_totals():
    out = nlq("plan", "test-two-arm", "--json", "data.path=/d")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    cluster = load_cluster("local-slurm")
    for run in doc["runs"]:
        assert (run["nodes"], run["gpus"], run["tp"], run["pp"], run["dp"]) == (2, 2, 1, 1, 2)
        assert (run["micro_batch_size"], run["grad_accum"], run["engine"]) == (4, 1, "megatron")
        assert run["tokens"] == 30 * 8 * 64
        cfg = load_run_config("cpu-xs", run["arm"])
        assert run["flops"] == flops_per_token(cfg.model) * run["tokens"]
        hours = run["flops"] / (cluster.peak_tflops * 1e12 * cluster.assumed_mfu) / 3600
        assert run["gpu_hours"] == pytest.approx(hours, abs=1e-4)
        assert set(run["memory_gb"]) == {"params", "grads", "optimizer", "activations", "total"}
    assert doc["totals"]["sweep"]["runs"] == 2
    assert doc["totals"]["per_scale"]["cpu-xs"]["flops"] == sum(r["flops"] for r in doc["runs"])
    table = nlq("plan", "test-two-arm", "data.path=/d").stdout
    assert "cpu-xs-nonlinear-s1234-lr0.003" in table and "GPU-h" in table


@pytest.mark.parametrize("arm", ["linear", "nonlinear"])
def test_memory_estimate_within_15_percent_of_bytes_allocated_on_cpu(arm):
    """Measured as nlq_scale/model/memory.py says (the reference model, fp32 AdamW, torch.profiler's
    allocator events); tests/test_arms.py checks the activations of every arm the same way."""
    from nlq_scale.model.memory import measure

    cfg = load_run_config("cpu-xs", arm, None, ["parallel.recompute=selective", "train.distributed_optimizer=false"])
    state_bytes, peak = measure(cfg)

    est = memory_per_device(cfg, one_device_layout(cfg))
    estimated_state = est.params + est.grads + est.optimizer
    assert estimated_state == pytest.approx(state_bytes, rel=0.15)
    assert est.activations == pytest.approx(peak, rel=0.15)
    assert est.total == pytest.approx(state_bytes + peak, rel=0.15)


def test_proxy_lr_search_prices_the_grid_at_the_proxy_width_and_the_confirmations_at_the_target():
    from nlq_scale.cluster.plan import proxy_config, proxy_search_cost
    from nlq_scale.cluster.sweep import sweep_path

    cluster = load_cluster("example-8x80gb")
    runs = plan_sweep(load_sweep(sweep_path("ladder")), cluster)
    target = runs[0].spec.cfg
    proxy = proxy_config(target, 384)
    m, p = target.model, proxy.model
    assert (p.hidden_size, p.num_layers, p.head_dim, p.num_attention_heads) == (384, m.num_layers, m.head_dim, 384 // m.head_dim)
    assert (p.parametrization, p.mup_base_hidden_size) == ("mup", 384)
    assert (proxy.train.steps, proxy.train.global_batch_size, p.seq_length) == (
        target.train.steps, target.train.global_batch_size, m.seq_length)  # the target's tokens

    cost = proxy_search_cost(runs, cluster, 384)
    assert cost["grid_gpu_hours"] == pytest.approx(sum(r.plan.gpu_hours for r in runs))
    per_run = {(r.spec.scale, r.spec.arm): r.plan.gpu_hours for r in runs}
    # 3 seeds at eta* + 1 seed at each of its two grid neighbours = 5 of the grid's 9 target runs
    assert cost["target_gpu_hours"] == pytest.approx(5 * sum(per_run.values()))
    assert 0 < cost["proxy_gpu_hours"] < 0.1 * cost["grid_gpu_hours"]
    assert cost["saving"] == pytest.approx(cost["grid_gpu_hours"] / (cost["proxy_gpu_hours"] + cost["target_gpu_hours"]))
    with pytest.raises(UsageError, match="--lr-proxy 100: must be a multiple of the head dim"):
        proxy_search_cost(runs, cluster, 100)


def test_plan_prints_the_proxy_lr_search_beside_the_grid():
    r = nlq("plan", "ladder", "--lr-proxy", "384", "--json")
    assert r.returncode == 0, r.stderr
    cost = json.loads(r.stdout)["lr_proxy"]
    assert cost["width"] == 384 and cost["saving"] > 1
    text = nlq("plan", "ladder", "--lr-proxy", "384").stdout
    assert "per-rung grid vs proxy at width 384" in text and "x less" in text


def test_planner_recomputes_the_query_mlp_before_halving_the_micro_batch():
    """On a device that holds 1.3b's nonlinear arm at its micro-batch only without the query MLP's
    activations, the planner turns parallel.recompute_query on (the run's config gets it); a sweep
    that pins it off gets a smaller micro-batch instead."""
    from nlq_scale.cluster.plan import Layout, apply_layout

    cfg = load_run_config("1.3b", "nonlinear", None, ["parallel.recompute=selective"])
    b = cfg.train.micro_batch_size
    at = {rq: memory_per_device(cfg, Layout(1, 1, 1, 1, 1, b, 512 // b, "selective", False, rq)).total
          for rq in (False, True)}  # fmt: skip
    assert at[True] < at[False]
    cluster = load_cluster("example-8x80gb").model_copy(
        update={"nodes": 1, "gpus_per_node": 1, "overhead_gb": 0.0, "memory_headroom": 1.0,
                "gpu_memory_gb": (at[True] + at[False]) / 2 / GB})  # fmt: skip
    chosen = plan_run(cfg, cluster, run_id="x", scale="1.3b", arm="nonlinear", fixed_tp=1, fixed_pp=1)
    assert chosen.fits and chosen.layout.recompute_query and chosen.layout.micro_batch_size == b
    assert apply_layout(cfg, chosen.layout, "x", cluster).parallel.recompute_query
    pinned = plan_run(cfg, cluster, run_id="x", scale="1.3b", arm="nonlinear", fixed_tp=1, fixed_pp=1,
                      recompute_query=False)
    assert not pinned.layout.recompute_query and pinned.layout.micro_batch_size < b
    linear = load_run_config("1.3b", "linear", None, ["parallel.recompute=selective"])
    assert not plan_run(linear, cluster, run_id="y", scale="1.3b", arm="linear").layout.recompute_query


@pytest.mark.parametrize("scale, whole_share_fits", [("124m", True), ("350m", False)])
def test_data_parallel_runs_get_the_largest_micro_batch_that_fits(scale, whole_share_fits):
    """Under data parallelism alone the micro-batch grows from a DP rank's whole share of the global
    batch down to the largest divisor that fits (124m's share fits on 80 GB, 350m's does not); with
    model parallelism it never exceeds the config's."""
    cluster = load_cluster("example-8x80gb")
    cfg = load_run_config(scale, "nonlinear")
    share = cfg.train.global_batch_size // 8
    run = plan_run(cfg, cluster, run_id="x", scale=scale, arm="nonlinear")
    mbs = run.layout.micro_batch_size
    assert run.fits and run.layout.dp == 8 and share % mbs == 0 and mbs > cfg.train.micro_batch_size
    larger = [d for d in range(mbs + 1, share + 1) if share % d == 0]
    assert (larger == []) == whole_share_fits, (mbs, share)
    for d in larger:  # every larger divisor of the share would not fit
        over = load_run_config(scale, "nonlinear", None, [f"train.micro_batch_size={d}"])
        assert not plan_run(over, cluster, run_id="x", scale=scale, arm="nonlinear", fixed_tp=1, fixed_pp=1,
                            fixed_micro_batch=True).fits  # fmt: skip
    big = load_run_config("13b", "linear")
    assert plan_run(big, cluster, run_id="y", scale="13b", arm="linear").layout.micro_batch_size <= big.train.micro_batch_size


def test_the_arms_of_a_scale_train_at_one_micro_batch():
    """Planned alone, 1.3b's nonlinear arm (more activations) gets a smaller micro-batch than linear on
    80 GB; in a sweep every run of the scale trains at the smaller one, so tokens/s compare alike."""
    cluster = load_cluster("example-8x80gb")
    alone = {arm: plan_run(load_run_config("1.3b", arm), cluster, run_id=arm, scale="1.3b", arm=arm).layout
             for arm in ("linear", "nonlinear")}  # fmt: skip
    assert alone["nonlinear"].micro_batch_size < alone["linear"].micro_batch_size
    runs = plan_sweep(load_sweep(sweep_path("ladder")), cluster, ["data.path=/d"])
    for scale in {r.spec.scale for r in runs}:
        at = {(r.plan.layout.micro_batch_size, r.plan.layout.grad_accum, r.cfg.train.micro_batch_size)
              for r in runs if r.spec.scale == scale}  # fmt: skip
        assert len(at) == 1, (scale, at)
    linear_13 = next(r for r in runs if r.spec.scale == "1.3b" and r.spec.arm == "linear")
    assert linear_13.plan.layout.micro_batch_size == alone["nonlinear"].micro_batch_size
    assert linear_13.plan.memory.total < memory_per_device(linear_13.cfg, alone["linear"]).total


# Peak memory (torch.cuda.max_memory_allocated) of 124M training steps on one H100: bf16, megatron
# engine, distributed optimizer, global batch 48 (docs/tested.md, fourth GPU session).
H100_124M_PEAK_GB = {("linear", "sdpa", 12): 9.02, ("nonlinear", "sdpa", 12): 9.67, ("linear", "sdpa", 48): 29.64,
                     ("nonlinear", "sdpa", 48): 32.19, ("linear", "stock", 12): 19.44, ("nonlinear", "stock", 12): 20.08}


@pytest.mark.parametrize(("arm", "attention", "mbs"), list(H100_124M_PEAK_GB))
def test_the_memory_model_covers_what_an_h100_allocated(arm, attention, mbs):
    """The planner's estimate is at least what the GPU allocated and at most 20% above it; megatron's
    unfused attention keeps 6 bytes per score in bf16 (fp32 softmax output and its bf16 copy)."""
    from nlq_scale.cluster.plan import Layout

    cfg = load_run_config("124m", arm, None, ["train.global_batch_size=48", f"model.core_attention={attention}"])
    estimate = memory_per_device(cfg, Layout(1, 1, 1, 1, 1, mbs, 48 // mbs, "none", False, False)).total / GB
    assert 1.0 <= estimate / H100_124M_PEAK_GB[(arm, attention, mbs)] <= 1.2
