"""The GPU path, checked on a CPU-only machine.

- `runtime.device=cuda` without CUDA stops before any work (exit 2, one line, nothing written).
- `runtime.check_device=true` keeps host and device tensors apart as CUDA does: the training paths
  of both engines pass under it (TP, PP, DP, EP, ZeRO-1, kills and resumes: every run of
  tests/test_train.py trains under the check; ZeRO-3 here), and putting back any one of the device
  bugs the GPU path once had (a batch, positions or the model left on the host, a host tensor in a
  collective) makes a run fail with a device-check error. Each mutation is applied to a copy of the
  package, so the test runs the real code with exactly one line changed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nlq_scale.config.load import load_run_config
from nlq_scale.errors import UsageError
from nlq_scale.runtime.device import resolve_device
from nlq_scale.runtime.device_check import DevicePlacementError, checking_devices
from tests.conftest import REPO, nlq, one_rank, read_metrics

CHECKED = [
    "train.steps=4", "train.warmup_steps=1", "train.eval_every=2", "checkpoint.every=2",
    "logging.wandb=false", "runtime.check_device=true",
]  # fmt: skip


def train(run_dir: Path, data: Path, *extra: str, nproc: int = 1, package_root: Path = REPO, arm: str = "nonlinear"):
    """`nlq-scale train` on the tiny scale, importing nlq_scale from `package_root`."""
    args = ["train", "--scale", "cpu-xs", "--arm", arm, "--run-dir", str(run_dir), f"data.path={data}",
            *CHECKED, *extra, "--nproc", str(nproc)]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "nlq_scale.cli", *args], cwd=package_root, capture_output=True, text=True,
        timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(package_root)},
    )  # fmt: skip


def test_cuda_asked_for_without_cuda_stops_before_any_work(sample_dataset, tmp_path):
    run_dir = tmp_path / "run"
    r = nlq("train", "--scale", "cpu-xs", "--arm", "linear", "--run-dir", str(run_dir),
            f"data.path={sample_dataset}", "runtime.device=cuda")  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "runtime.device" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not run_dir.exists()


def test_device_resolution_on_a_cpu_machine():
    assert resolve_device("auto", 0).torch_device == torch.device("cpu")
    assert resolve_device("cpu", 3).backend == "gloo"
    with pytest.raises(UsageError, match="runtime.device=cuda: CUDA is not available"):
        resolve_device("cuda", 0)


def test_check_mode_catches_host_device_mixes_and_host_collectives():
    import torch.distributed as dist

    from nlq_scale.runtime.device import Device

    device = Device(torch.device("cpu"))
    with checking_devices():
        weight = device.put(torch.randn(4, 4))
        host = torch.randn(2, 4)
        assert (device.put(host) @ weight).shape == (2, 4)
        assert (weight * torch.tensor(2.0)).shape == (4, 4)  # a host scalar is fine, as on CUDA
        with pytest.raises(DevicePlacementError, match="mixes host tensor"):
            host @ weight
        param = torch.nn.Parameter(torch.zeros(3))  # made on the host: stays a host tensor
        with pytest.raises(DevicePlacementError):
            param + device.tensor([1.0, 2.0, 3.0])
        with pytest.raises(DevicePlacementError, match="all_reduce got host tensor"):
            dist.all_reduce(torch.zeros(2))
    assert (torch.randn(2, 4) @ torch.randn(4, 4)).shape == (2, 4)  # nothing left behind


def test_fused_softmax_only_where_the_kernel_is_installed():
    """bf16 on a GPU turned megatron's fused softmax on, whose CUDA extension was not installed."""
    from nlq_scale.model.gpt import transformer_config
    from nlq_scale.runtime.kernels import probe

    cfg = load_run_config(scale="124m", arm="nonlinear", overrides=["model.bf16=true"])
    tc = transformer_config(cfg.model, cfg.parallel, device=torch.device("cuda"))
    assert tc.masked_softmax_fusion is probe().fused_softmax is False
    assert tc.use_cpu_initialization is False  # on CUDA megatron creates its weights on the device


def test_transformer_engine_is_refused_where_it_cannot_run(sample_dataset, tmp_path):
    r = nlq("config", "show", "--scale", "cpu-xs", "--arm", "preproj", "model.transformer_impl=transformer_engine")
    assert r.returncode == 2 and "cannot be built from the Transformer Engine spec" in r.stderr
    r = nlq("train", "--scale", "cpu-xs", "--arm", "nonlinear", "--run-dir", str(tmp_path / "run"),
            f"data.path={sample_dataset}", "model.transformer_impl=transformer_engine")  # fmt: skip
    assert r.returncode == 2 and "pip install 'nlq-scale[gpu]'" in r.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_zero3_trains_under_the_device_check(sample_dataset, tmp_path):
    """ZeRO-3 partitions the parameters DeepSpeed gathers on each use: the one training path
    tests/test_train.py's runs (all under the check) do not take."""
    run_dir = tmp_path / "run"
    r = train(run_dir, sample_dataset, "train.engine=deepspeed", "train.zero_stage=3", nproc=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = json.loads((run_dir / "status.json").read_text())  # trained to the end under the check
    assert (status["state"], status["step"]) == ("completed", 4), status
    assert [m["step"] for m in read_metrics(run_dir) if "val/loss" in m][-1] == 4


# One bug each, as the code had it before the runtime owned the device: (file, fixed line, bug).
MUTATIONS = {
    "batch-left-on-host": (
        "train/feed.py",
        "buf = self.device.put(tokens.contiguous()) if tokens is not None",
        "buf = tokens.contiguous() if tokens is not None",
    ),
    "positions-left-on-host": (
        "train/engine_megatron.py",
        "self._positions = device.put(torch.arange(cfg.model.seq_length).unsqueeze(0))",
        "self._positions = torch.arange(cfg.model.seq_length).unsqueeze(0)",
    ),
    "model-left-on-host": (
        "train/engine_megatron.py",
        "model = model.to(device.torch_device)",
        "model = model",
    ),
    "deepspeed-positions-left-on-host": (
        "train/engine_deepspeed.py",
        "self._positions = device.put(torch.arange(cfg.model.seq_length).unsqueeze(0))",
        "self._positions = torch.arange(cfg.model.seq_length).unsqueeze(0)",
    ),
    "host-flag-in-all-reduce": ("train/loop.py", "t = device.tensor([int(flag)])", "t = torch.tensor([int(flag)])"),
    "host-loss-in-all-reduce": (
        "train/engine_common.py",
        "total = device.tensor([sum(values) / max(len(values), 1), float(contributes)], dtype=torch.float64)",
        "total = torch.tensor([sum(values) / max(len(values), 1), float(contributes)], dtype=torch.float64)",
    ),
    "host-digests-in-all-gather": (
        "data/loader.py",
        "local = device.put(digests) if device is not None else digests",
        "local = digests",
    ),
    "host-flags-in-feed-all-gather": (
        "train/feed.py",
        "self.device.tensor([int(_is_loader(self.world))])",
        "torch.tensor([int(_is_loader(self.world))])",
    ),
    "host-buffer-in-feed-broadcast": (
        "train/feed.py",
        "else self.device.empty(shape, torch.int64)",
        "else torch.empty(shape, dtype=torch.int64)",
    ),
}
NEEDS = {
    # With the distributed optimizer, megatron's DDP re-homes every parameter into its device-side
    # buffer (param.data = view), on a GPU too: the bug bites with the plain optimizer.
    "model-left-on-host": (["train.distributed_optimizer=false"], 1),
    "deepspeed-positions-left-on-host": (["train.engine=deepspeed"], 1),
    "host-flags-in-feed-all-gather": (["parallel.tp=2"], 2),
    "host-buffer-in-feed-broadcast": (["parallel.tp=2"], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_device_bug_put_back_fails_the_check(name, sample_dataset, tmp_path):
    path, fixed, bug = MUTATIONS[name]
    copy = tmp_path / "src"
    shutil.copytree(REPO / "nlq_scale", copy / "nlq_scale", ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / "nlq_scale" / path
    text = source.read_text()
    assert text.count(fixed) == 1, f"{path} no longer has the line this mutation replaces: {fixed}"
    source.write_text(text.replace(fixed, bug))
    extra, nproc = NEEDS.get(name, ([], 1))
    r = train(tmp_path / "run", sample_dataset, *extra, nproc=nproc, package_root=copy)
    assert r.returncode != 0, f"{name}: the mutated run passed the device check"
    assert "device check:" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


def _first_loss_after_host_draws(make_engine, cfg, tokens, host_seed: int) -> float:
    torch.manual_seed(host_seed)  # whatever drew from the host generator before the engine
    return make_engine(cfg).train_step(tokens).loss


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_initial_weights_do_not_hang_on_the_host_generator(engine, monkeypatch):
    """On a GPU megatron's seeding reaches CUDA's generators only, while the norms, position
    embeddings and arm modules are initialised on the host: each engine must seed the host
    generator itself (an H200 run started every process from other weights until it did)."""
    from tests.scripts import deepspeed_engine as script

    with one_rank():
        for namespace in (torch.cuda, torch.cuda.random):  # as with CUDA: seeding it leaves the host alone
            monkeypatch.setattr(namespace, "manual_seed", lambda *_a, **_k: None)
        cfg = script.config(["train.steps=1"])
        tokens = script.batches(cfg, 1, seed=0)[0]
        make = getattr(script, f"{engine}_engine")
        losses = {_first_loss_after_host_draws(make, cfg, tokens, host_seed) for host_seed in (1, 2)}
    assert len(losses) == 1, f"{engine}: the first loss depends on the host generator's earlier state: {losses}"


def test_a_distributed_block_leaves_the_launch_environment_as_it_found_it(monkeypatch):
    """A one-process block's MASTER_PORT was free only when picked: no library run after the block may
    find it (accelerate, inside `nlq eval`, once tried to listen on it after another process took it)."""
    import os

    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.runtime.dist import LAUNCH_ENV, distributed

    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")  # no RANK: not a launcher's, so the block replaces it
    with distributed(ParallelConfig(), device="cpu"):
        assert os.environ["LOCAL_RANK"] == "0" and os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert {name: os.environ.get(name) for name in LAUNCH_ENV} == dict.fromkeys(LAUNCH_ENV) | {"MASTER_ADDR": "10.1.2.3"}


def test_deterministic_kernels_on_cuda_only_and_for_the_block_only(monkeypatch):
    """runtime.deterministic: torch's deterministic algorithms without the NaN fill of new tensors, a
    fixed cuBLAS workspace (unless the user set one) and megatron's deterministic_mode, on CUDA; the
    CPU path is left as it is."""
    import os

    from nlq_scale.config.schema import RunConfig
    from nlq_scale.model.gpt import transformer_config
    from nlq_scale.runtime.device import Device, deterministic_kernels

    cuda, cpu = Device(torch.device("cuda", 0)), Device(torch.device("cpu"))  # no CUDA call is made
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # so that monkeypatch removes what the block sets
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    for device, enabled in ((cpu, True), (cuda, False)):
        with deterministic_kernels(device, enabled):
            assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(cuda, True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory  # no NaN fill of every new tensor
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory  # torch's default, back
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_kernels(cuda, True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    cfg = RunConfig()
    assert RunConfig().runtime.deterministic
    assert transformer_config(cfg.model, cfg.parallel, cuda.torch_device, deterministic=True).deterministic_mode
    assert not transformer_config(cfg.model, cfg.parallel, cuda.torch_device, deterministic=False).deterministic_mode
    assert not transformer_config(cfg.model, cfg.parallel, cpu.torch_device, deterministic=True).deterministic_mode
