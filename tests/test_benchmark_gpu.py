"""benchmarks/gpu.py: its summary (ratios, goals) from given cells, and its smoke run, the same cells and code
on the CPU, checked for the structure of its one JSON line and for positive measurements. It has not run
on a GPU here (docs/tested.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

BENCHMARK = REPO / "benchmarks" / "gpu.py"


def benchmark_module():
    """benchmarks/gpu.py as a module (its dataclasses look their module up in sys.modules)."""
    if "gpu_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_benchmark", BENCHMARK)
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules["gpu_benchmark"]


def test_summary_sets_ratios_and_goals_beside_the_cells():
    gpu = benchmark_module()
    measured = {
        ("124m", "linear", "default"): {"tokens_per_s": 200.0, "mfu": 0.30},
        ("124m", "nonlinear", "default"): {"tokens_per_s": 150.0, "mfu": 0.25},
        ("124m", "linear", "cuda_graphs_local"): {"tokens_per_s": 300.0, "mfu": 0.45},
        ("124m", "nonlinear", "cuda_graphs_local"): {"tokens_per_s": 291.0, "mfu": 0.44},
        ("1.3b", "linear", "default"): {"tokens_per_s": 10.0, "mfu": 0.42},
        ("1.3b", "nonlinear", "default"): {"error": "OutOfMemoryError: CUDA out of memory."},
        ("1.3b", "linear", "cuda_graphs_local"): {"skipped": "the time budget for all cells (440 s) was spent"},
        ("1.3b", "nonlinear", "cuda_graphs_local"): {"skipped": "the time budget for all cells (440 s) was spent"},
    }
    out = gpu.summary({gpu.Cell(*key, overrides=()): result for key, result in measured.items()})
    assert out["cells"]["1.3b"]["nonlinear"]["default"] == {"error": "OutOfMemoryError: CUDA out of memory."}
    assert out["ratios"]["124m"]["nonlinear_over_linear"] == {"default": 0.75, "cuda_graphs_local": 0.97}
    assert out["ratios"]["124m"]["linear"] == {"cuda_graphs_local_over_default": 1.5}
    assert out["ratios"]["1.3b"]["nonlinear_over_linear"] == {"default": None, "cuda_graphs_local": None}
    assert out["goal_check"]["124m"] == {
        "mfu_linear": {"goal": 0.40, "default": 0.30, "best": ["cuda_graphs_local", 0.45], "met": True},
        "nonlinear_over_linear": {"goal": 0.95, "default": 0.75, "best": ["cuda_graphs_local", 0.97], "met": True},
    }
    assert out["goal_check"]["1.3b"] == {"mfu_linear": {"goal": 0.50, "default": 0.42, "best": ["default", 0.42], "met": False}}


def test_cells_measure_the_defaults_of_every_scale_first_and_every_lever_for_both_arms():
    gpu = benchmark_module()
    cells = gpu.cells(gpu.GPU)
    assert [(c.scale, c.arm, c.lever) for c in cells[:4]] == [
        ("124m", "linear", "default"), ("124m", "nonlinear", "default"),
        ("1.3b", "linear", "default"), ("1.3b", "nonlinear", "default"),
    ]  # fmt: skip
    levers = {scale: {c.lever for c in cells if c.scale == scale} for scale in ("124m", "1.3b")}
    assert levers["124m"] == {"default", *gpu.LEVERS, "micro_batch_24", "micro_batch_48"}
    assert levers["1.3b"] == {"default", *gpu.LEVERS, "micro_batch_8"}
    assert all("train.global_batch_size=48" in c.overrides for c in cells if c.scale == "124m")


@pytest.mark.slow
def test_smoke_runs_every_cell_on_the_cpu_in_one_json_line():
    out = subprocess.run([sys.executable, str(BENCHMARK), "--smoke"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout)  # the one line: nothing else on stdout
    assert (line["benchmark"], line["smoke"], line["device"]) == ("gpu", True, "cpu")
    assert line["goals"] == {"124m": {"mfu_linear": 0.40, "nonlinear_over_linear": 0.95}, "1.3b": {"mfu_linear": 0.50}}
    levers = {"default", "cuda_graphs_local", "cuda_graphs_full_iteration", "transformer_engine", "deterministic_off",
              "micro_batch_8", "micro_batch_16"}  # fmt: skip
    cells = line["cells"]["cpu-xs"]
    assert set(cells) == {"linear", "nonlinear"} and all(set(by_lever) == levers for by_lever in cells.values())
    for by_lever in cells.values():
        for lever in ("cuda_graphs_local", "cuda_graphs_full_iteration"):
            assert "parallel.cuda_graph_impl" in by_lever[lever]["skipped"] and "runtime.device=cpu" in by_lever[lever]["skipped"]
        assert "transformer_engine" in by_lever["transformer_engine"]["skipped"]
        measured = [by_lever[lever] for lever in ("default", "deterministic_off", "micro_batch_8")]
        assert all(m["tokens_per_s"] > 0 and m["mfu"] > 0 and m["peak_memory_gb"] > 0 for m in measured), measured
    ratios = line["ratios"]["cpu-xs"]
    assert ratios["nonlinear_over_linear"]["default"] > 0 and ratios["linear"]["deterministic_off_over_default"] > 0
    assert ratios["nonlinear"]["cuda_graphs_local_over_default"] is None
