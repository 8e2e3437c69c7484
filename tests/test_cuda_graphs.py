"""parallel.cuda_graph_impl (megatron-core's CUDA graphs) as far as a CPU can check it: what the config
refuses, what it passes on to megatron's TransformerConfig, and the engine's refusal of a run that
resolved to the CPU. The graphs themselves have not run on a GPU here (docs/tested.md)."""

from __future__ import annotations

import re

import pytest
import torch

from nlq_scale.config import load_run_config
from nlq_scale.errors import UsageError


def graphs_config(impl: str, *overrides: str):
    return load_run_config("cpu-xs", "nonlinear", overrides=[f"parallel.cuda_graph_impl={impl}", *overrides])


@pytest.mark.parametrize("impl", ["local", "full_iteration"])
@pytest.mark.parametrize("refused, reason", [
    ("runtime.device=cpu", "runtime.device=cpu (graphs capture CUDA kernels)"),
    ("runtime.check_device=true", "runtime.check_device (a CPU run)"),
    ("train.engine=deepspeed", "train.engine=deepspeed (megatron's schedule runs the graphs)"),
    ("parallel.graph_query=true", "parallel.graph_query (a graph inside megatron's)"),
    ("model.moe.num_experts=4", "model.moe.num_experts (the token dispatch syncs with the host)"),
])  # fmt: skip
def test_cuda_graphs_refuse_what_cannot_be_captured_in_one_line(impl, refused, reason):
    with pytest.raises(UsageError, match=re.escape(f"parallel.cuda_graph_impl={impl}: unsupported with {reason}")) as e:
        graphs_config(impl, refused)
    assert "\n" not in str(e.value)


def test_local_graphs_refuse_full_recompute_as_megatron_does():
    with pytest.raises(UsageError, match=re.escape("parallel.recompute=full (megatron: with full_iteration only)")):
        graphs_config("local", "parallel.recompute=full")


@pytest.mark.parametrize("impl, overrides", [
    ("local", ["parallel.recompute=selective", "parallel.recompute_query=true", "parallel.compile_query=true"]),
    ("local", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("full_iteration", ["parallel.recompute=full", "parallel.pp=2"]),
    ("full_iteration", ["model.transformer_impl=transformer_engine", "runtime.deterministic=false"]),
])  # fmt: skip
def test_cuda_graphs_reach_megatrons_config_capturing_whole_layers(impl, overrides):
    """What megatron accepts passes: its TransformerConfig (built here for a CUDA device, not run) gets the
    implementation and no module list (local graphs then capture the whole layer, the arm's query inside)."""
    from nlq_scale.model.gpt import transformer_config

    cfg = graphs_config(impl, *overrides)
    config = transformer_config(cfg.model, cfg.parallel, torch.device("cuda"))
    assert (config.cuda_graph_impl, config.cuda_graph_modules) == (impl, [])
    assert transformer_config(cfg.model, cfg.parallel.model_copy(update={"cuda_graph_impl": "none"}),
                              torch.device("cuda")).cuda_graph_impl == "none"  # fmt: skip


def test_the_engine_refuses_cuda_graphs_where_auto_gave_the_cpu():
    """runtime.device=auto passes the config, and resolves only where the run starts: on a host without
    CUDA the engine stops before building anything."""
    from nlq_scale.runtime.device import Device
    from nlq_scale.train.engine_megatron import MegatronEngine

    cfg = graphs_config("local")
    assert cfg.runtime.device == "auto"
    with pytest.raises(UsageError, match=re.escape("parallel.cuda_graph_impl=local: needs a CUDA device (runtime.device=auto gave the CPU)")):
        MegatronEngine(cfg, Device(torch.device("cpu")))
