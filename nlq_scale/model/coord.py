"""The coordinate check (Tensor Programs V, Figure 5): does every activation keep its size as width grows?

For each width, a 2-layer model of the arm (head dim fixed, heads = width / head dim, a small
vocabulary) trains a few Adam steps with the megatron engine on one fixed synthetic token stream, and
forward hooks record, on a fixed probe batch, the mean |activation| of every module (per role,
averaged over layers) at init, after training, and its change since init. The slope of
log(mean |.|) against log(width) says how each one scales.

What muP predicts at a finite width, and so what the verdict asks of it: at init every module is
flat but the readout, whose logits (1/w times a sum of w terms of random sign) fall as width^-1/2;
after training nothing grows, and a module may fall, but no faster than width^-1/2. That fall is
the finite-width part of Adam's updates: the part of an update incoherent with the probe's inputs
moves a coordinate by ~width^-1/2 of the coherent part, and being independent of it, it adds to a
coordinate's size, so it shows as a slope in (-1/2, 0) that fades as the models widen
(docs/coord-check.md). A wrong power of width in an init, a learning rate or a multiplier shows as
a slope at init, a growth, or a steeper fall; docs/mup.md lists the injected mistakes each part of
the verdict catches. Under the standard parametrization the hidden outputs grow with width.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nlq_scale.model.mup import unwrapped

if TYPE_CHECKING:  # torch is imported where a model is built: the CLI's parser imports this module
    from torch import Tensor

    from nlq_scale.config.schema import RunConfig

HEAD_DIM = 16
VOCAB = 512
SEQ = 32
# Few tokens per step: the infinite-width behaviour muP is built for needs tokens per step << width
# (with as many tokens as hidden units the gradient is full rank and updates stop adding up coherently,
# a finite-width effect that shows as slopes of +-0.3 at widths 64-512 with 8 x 64 tokens).
BATCH = 2
PROBE_ROWS = 16  # the probe averages over more tokens than a step trains on
MUP_GROWTH = 0.1  # muP: every slope after training stays under this...
MUP_DECAY = -0.5  # ...and over this (the finite-width part of an update shrinks as width^-1/2)
MUP_INIT = 0.1  # muP at init: every |slope| under this, the readout's within this of READOUT_INIT
READOUT_INIT = -0.5  # the logits at init: 1/w times a sum over the width
READOUT = "output_layer"
STANDARD_STEEP = 0.2  # |slope| some module must exceed under the standard parametrization
STATS = {"init": "init_", "activation": "", "update": "update_"}  # statistic -> its slope's key prefix
TRAINED = ("slope", "update_slope")
_LAYER = re.compile(r"^decoder\.layers\.\d+\.")


@dataclass
class CoordCheckSpec:
    arm: str
    parametrizations: tuple[str, ...] = ("standard", "mup")
    widths: tuple[int, ...] = (64, 128, 256, 512)
    steps: int = 20
    lr: float = 3e-3  # cpu-xs's learning rate
    # One seed's attention logits are noisy (10-80% from seed to seed): with 4 seeds, one seed set in
    # six gives the linear arm's a growth over MUP_GROWTH (docs/mup.md).
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)


# Per statistic (STATS) and module role: [width][seed] values.
Curves = dict[str, dict[str, list[list[float]]]]


def run_config(spec: CoordCheckSpec, parametrization: str, width: int, seed: int) -> RunConfig:
    from nlq_scale.config import load_run_config

    return load_run_config("cpu-xs", spec.arm, overrides=[
        "model.num_layers=2", f"model.hidden_size={width}", f"model.num_attention_heads={width // HEAD_DIM}",
        f"model.kv_channels={HEAD_DIM}", f"model.seq_length={SEQ}", f"model.vocab_size={VOCAB}",
        "model.make_vocab_size_divisible_by=128", f"model.parametrization={parametrization}",
        f"model.mup_base_hidden_size={spec.widths[0]}", f"train.global_batch_size={BATCH}",
        f"train.micro_batch_size={BATCH}", f"train.lr={spec.lr}", "train.grad_clip=0", "train.weight_decay=0",
        "train.warmup_steps=0", f"train.steps={spec.steps}", f"seed={seed}", "logging.wandb=false",
        "train.distributed_optimizer=false",  # one rank: the same Adam step without sharding's copies (11% faster)
    ])  # fmt: skip


def token_batches(count: int, rows: int, seed: int) -> list[Tensor]:
    """`count` batches of `rows` sequences from a Zipf-distributed token stream (something to learn),
    the same at every width."""
    import torch

    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    return [torch.multinomial(probs, rows * (SEQ + 1), replacement=True, generator=g).view(rows, SEQ + 1)
            for _ in range(count)]  # fmt: skip


def _first_tensor(out) -> Tensor:
    """megatron's linears return (output, bias)."""
    return out[0] if isinstance(out, tuple) else out


def _role(name: str) -> str:
    return _LAYER.sub("", unwrapped(name))


class Recorder:
    """Forward hooks on every module that holds parameters, the arm's query module, the core
    attention (whose hook records the q and k it receives and computes the causal attention logits)
    and the GPT, whose output is the readout (READOUT): megatron's muP multiplies the logits after
    the output layer."""

    def __init__(self, model) -> None:
        self.outputs: dict[str, list[Tensor]] = defaultdict(list)
        self.handles = []
        for name, module in model.named_modules():
            if name.endswith("core_attention"):
                self.handles.append(module.register_forward_pre_hook(self._logits_hook(name, module), with_kwargs=True))
            elif name.endswith(READOUT):
                gpt = model.get_submodule(name.rpartition(".")[0])
                self.handles.append(gpt.register_forward_hook(self._output_hook(name)))
            elif name.endswith("self_attention.query") or any(True for _ in module.parameters(recurse=False)):
                self.handles.append(module.register_forward_hook(self._output_hook(name)))

    def _output_hook(self, name: str):
        def hook(_module, _inputs, out):
            self.outputs[_role(name)].append(_first_tensor(out).detach().float().clone())

        return hook

    def _logits_hook(self, name: str, module):
        import torch

        def hook(_module, args, kwargs):
            query, key = (list(args) + [kwargs.get("query"), kwargs.get("key")])[:2]
            q, k = query.float(), key.float()  # [s, b, heads, d], [s, b, groups, d]
            k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
            logits = torch.einsum("sbhd,tbhd->bhst", q, k) * module.softmax_scale
            causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
            role = _role(name).replace("core_attention", "attention_{}")
            # q and k as attention sees them (after any QK-norm and RoPE): which side moves the logits
            for part, tensor in (("logits", logits[..., causal]), ("q", q), ("k", k)):
                self.outputs[role.format(part)].append(tensor.detach().clone())

        return hook

    def take(self) -> dict[str, list[Tensor]]:
        out, self.outputs = dict(self.outputs), defaultdict(list)
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _probe(engine, recorder: Recorder, probe: Tensor) -> dict[str, list[Tensor]]:
    engine.evaluate(probe)
    return recorder.take()


def measure_width(spec: CoordCheckSpec, parametrization: str, width: int, seed: int) -> dict[str, dict[str, float]]:
    """Per statistic (STATS: mean |activation| at init and after training, mean |change since
    init|), per module role, at one width and seed."""
    import torch

    from nlq_scale.runtime.device import Device
    from nlq_scale.train.engine_megatron import MegatronEngine

    cfg = run_config(spec, parametrization, width, seed)
    engine = MegatronEngine(cfg, Device(torch.device("cpu")))
    batches = token_batches(spec.steps, BATCH, seed)
    (probe,) = token_batches(1, PROBE_ROWS, seed + 10_000)
    recorder = Recorder(engine.model)
    try:
        before = _probe(engine, recorder, probe)
        for tokens in batches:
            engine.set_lr(spec.lr)
            engine.train_step(tokens)
        recorder.take()  # the training steps' own activations
        after = _probe(engine, recorder, probe)
    finally:
        recorder.close()
        engine.close()
    update = {
        role: float(np.mean([(t - t0).abs().mean().item() for t, t0 in zip(ts, before[role], strict=True)]))
        for role, ts in after.items()
    }
    return {"init": _sizes(before), "activation": _sizes(after), "update": update}


def _sizes(outputs: dict[str, list[Tensor]]) -> dict[str, float]:
    """Mean |.| per role, averaged over its layers."""
    return {role: float(np.mean([t.abs().mean().item() for t in ts])) for role, ts in outputs.items()}


def slope(widths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) on log(width); 0 for a curve that is identically 0."""
    if min(values) <= 0.0:
        return 0.0 if max(values) <= 0.0 else math.inf
    return float(np.polyfit(np.log(widths), np.log(values), 1)[0])


BOOTSTRAP = 2000  # seed resamples per interval


def slope_interval(widths: list[int], per_seed: np.ndarray, level: float = 0.95) -> list[float] | None:
    """A seed-bootstrap interval for the slope of the seed-mean curve: `per_seed` is [seed, width].
    The attention logits' mean |.| varies so much from seed to seed at the narrow widths (a few
    heads) that two sets of 12 seeds gave the linear arm's slope as -0.09 and -0.30. None with
    fewer than two seeds or a curve that touches 0."""
    if per_seed.shape[0] < 2 or per_seed.min() <= 0.0:
        return None
    rng = np.random.default_rng(0)
    resampled = per_seed[rng.integers(0, per_seed.shape[0], (BOOTSTRAP, per_seed.shape[0]))].mean(axis=1)
    x = np.log(widths) - np.log(widths).mean()
    y = np.log(resampled)
    slopes = (y - y.mean(axis=1, keepdims=True)) @ x / (x @ x)
    tail = 100 * (1 - level) / 2
    return [float(v) for v in np.percentile(slopes, [tail, 100 - tail])]


def check(spec: CoordCheckSpec) -> dict:
    """Needs a one-process torch.distributed world (nlq_scale.runtime.dist.distributed)."""
    result = {"arm": spec.arm, "widths": list(spec.widths), "steps": spec.steps, "lr": spec.lr,
              "seeds": list(spec.seeds), "head_dim": HEAD_DIM, "parametrizations": {}}  # fmt: skip
    for parametrization in spec.parametrizations:
        curves: Curves = {stat: defaultdict(list) for stat in STATS}
        for width in spec.widths:
            per_seed = [measure_width(spec, parametrization, width, seed) for seed in spec.seeds]
            for stat, by_role in curves.items():
                for role in per_seed[0][stat]:
                    by_role[role].append([m[stat][role] for m in per_seed])
        modules = {role: _module(spec.widths, curves, role) for role in curves["activation"]}
        result["parametrizations"][parametrization] = _summarize(modules)
    result["verdict"] = verdict(result)
    return result


def _module(widths: list[int], curves: Curves, role: str) -> dict:
    """One module's seed-mean curves, their slopes and the slopes' seed-bootstrap intervals."""
    out = {}
    for stat, prefix in STATS.items():
        per_seed = np.array(curves[stat][role]).T  # [seed, width]
        mean = [float(v) for v in per_seed.mean(axis=0)]
        out[stat] = mean
        out[f"{prefix}slope"] = slope(widths, mean)
        out[f"{prefix}slope_interval"] = slope_interval(widths, per_seed)
    return out


def _summarize(modules: dict) -> dict:
    """One parametrization's modules with what the verdict reads: the steepest trained slope (the
    largest |slope|), the largest growth and fall after training, and the steepest slope at init
    of every module but the readout, beside the readout's."""

    def value(pick: tuple[str, str]) -> float:
        return modules[pick[0]][pick[1]]

    def named(pick: tuple[str, str]) -> dict:
        role, stat = pick
        return {"module": role, "slope": stat, "value": value(pick), "interval": modules[role][f"{stat}_interval"]}

    trained = [(role, stat) for role in modules for stat in TRAINED]
    at_init = [(role, "init_slope") for role in modules if role != READOUT]
    steepest = named(max(trained, key=lambda pick: abs(value(pick))))
    return {
        "modules": modules,
        "max_abs_slope": abs(steepest["value"]),
        "steepest": steepest,
        "growth": named(max(trained, key=value)),
        "decay": named(min(trained, key=value)),
        "init": named(max(at_init, key=lambda pick: abs(value(pick)))),
        "readout_init_slope": modules[READOUT]["init_slope"],
    }


def verdict(result: dict) -> dict:
    """muP: flat at init but the readout (READOUT_INIT), no growth over MUP_GROWTH and no fall
    under MUP_DECAY after training; standard: some |slope| (activation or update) > STANDARD_STEEP."""
    p = result["parametrizations"]
    out = {}
    if "mup" in p:
        m = p["mup"]
        readout_off = abs(m["readout_init_slope"] - READOUT_INIT)
        out["mup_init_flat"] = abs(m["init"]["value"]) < MUP_INIT and readout_off < MUP_INIT
        out["mup_no_growth"] = m["growth"]["value"] < MUP_GROWTH
        out["mup_decay_bounded"] = m["decay"]["value"] > MUP_DECAY
    if "standard" in p:
        out["standard_drifts"] = p["standard"]["max_abs_slope"] > STANDARD_STEEP
    return out


def plot(result: dict, path: Path) -> None:
    """One panel per parametrization and statistic: mean |.| against width, a line per module."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = list(result["parametrizations"])
    fig, axes = plt.subplots(len(STATS), len(params), figsize=(6 * len(params), 4 * len(STATS)), squeeze=False)
    for col, name in enumerate(params):
        for row, stat in enumerate(STATS):
            ax = axes[row][col]
            for i, (role, m) in enumerate(result["parametrizations"][name]["modules"].items()):
                ax.plot(result["widths"], m[stat], marker="o", color=plt.get_cmap("tab20")(i % 20), label=role)
            what = "change since init" if stat == "update" else "activation"
            when = "at init" if stat == "init" else f"after {result['steps']} steps"
            ax.set(xscale="log", yscale="log", xlabel="width", ylabel=f"mean |{what}|",
                   title=f"{result['arm']} {name}: {what} {when}")  # fmt: skip
    axes[0][-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
