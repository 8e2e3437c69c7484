"""The nonlinear-query authors' nanoGPT checkpoints (their model.py, bias=False: LayerNorms without
bias, no linear biases, learned positions) as a run directory, so that `export` and `generate` (and
anything else that reads run directories' checkpoints) take them as they take ours.

Their query mode picks the arm (`Arm.nanogpt_mode`); the arm names its query weights in their code
(`Arm.nanogpt_names`). The weights go through the reference model into a TP=1 megatron GPT and are
saved as the megatron engine saves them. The run directory holds the model only (no optimizer
state or data position): it is for evaluation, `train` cannot resume it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from nlq_scale import arms
from nlq_scale.arms.base import Arm
from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import UsageError
from nlq_scale.train import untrusted

GPT2_VOCAB = 50257
COMPILED_PREFIX = "_orig_mod."  # torch.compile'd models save their state under this prefix


def read_authors_checkpoint(path: Path) -> tuple[dict[str, Tensor], dict, int]:
    """(state dict, model_args, iter_num) of a nanoGPT ckpt.pt, or of a bare state dict file."""
    if not path.is_file():
        raise UsageError(f"{path}: no such checkpoint file")
    with untrusted.weights_only_loads(path):
        saved = untrusted.load(path)
    if not isinstance(saved, dict):
        raise UsageError(f"{path}: not a nanoGPT checkpoint (a dict with 'model', or a state dict)")
    state = saved.get("model", saved)
    state = {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items() if isinstance(v, Tensor)}
    if "transformer.wte.weight" not in state:
        raise UsageError(f"{path}: no transformer.wte.weight: not a nanoGPT GPT state dict")
    return state, dict(saved.get("model_args") or {}), int(saved.get("iter_num") or 0)


def arm_for_mode(mode: str) -> Arm:
    found = [a for a in arms.all_arms() if a.nanogpt_mode == mode]
    if not found:
        known = sorted(a.nanogpt_mode for a in arms.all_arms() if a.nanogpt_mode)
        raise UsageError(f"--mode {mode}: no arm is this query mode (known: {', '.join(known)})")
    return found[0]


def _mode(model_args: dict, mode: str | None, path: Path) -> str:
    mode = mode or model_args.get("query_mode")
    if mode is None:
        raise UsageError(f"{path}: model_args has no query_mode: pass --mode")
    return mode


def authors_run_config(
    state: dict[str, Tensor], model_args: dict, arm: Arm, heads: int | None, path: Path
) -> RunConfig:
    """Our config for their model: its shape read from the weights (heads from model_args or --heads)."""
    from nlq_scale.config.load import load_run_config

    heads = heads or model_args.get("n_head")
    if heads is None:
        raise UsageError(f"{path}: model_args has no n_head: pass --heads")
    wte = state["transformer.wte.weight"]
    rows, d = wte.shape
    layers = sum(1 for k in state if k.startswith("transformer.h.") and k.endswith(".ln_1.weight"))
    lm_head = state.get("lm_head.weight")
    vocab = [f"model.vocab_size={GPT2_VOCAB}", "model.make_vocab_size_divisible_by=128"]
    if -(-GPT2_VOCAB // 128) * 128 != rows:
        vocab = [f"model.vocab_size={rows}", "model.make_vocab_size_divisible_by=1"]
    overrides = [
        f"model.arm={arm.name}", f"model.num_layers={layers}", f"model.hidden_size={d}",
        f"model.num_attention_heads={heads}", f"model.kv_channels={d // heads}",
        f"model.seq_length={state['transformer.wpe.weight'].shape[0]}",
        f"model.mlp_ratio={state['transformer.h.0.mlp.c_fc.weight'].shape[0] / d}",
        f"model.tie_embeddings={lm_head is None or torch.equal(lm_head, wte)}",
        "model.norm_bias=false", "model.add_bias_linear=false", "model.bf16=false", "model.qk_norm=none",
        "model.position_embedding=learned_absolute", "model.normalization=LayerNorm", *vocab,
    ]  # fmt: skip
    try:
        return load_run_config(scale="124m", overrides=overrides)
    except UsageError as e:
        raise UsageError(f"{path}: its shape is no valid model here ({e})") from None


def reference_state(state: dict[str, Tensor], cfg: RunConfig, arm: Arm) -> dict[str, Tensor]:
    """Their weights under our reference model's names (nlq_scale.model.reference)."""
    m, d = cfg.model, cfg.model.hidden_size
    export_to_reference = {w.export: w.reference for w in arm.weight_names(m)}
    theirs = dict(state)
    own = {f"{n}.weight": theirs.pop(f"transformer.{n}.weight") for n in ("wte", "wpe", "ln_f")}
    head = theirs.pop("lm_head.weight", None)
    if not m.tie_embeddings:
        own["lm_head.weight"] = head
    query = {ours: their for their, ours in arm.nanogpt_names(m).items()}
    for i in range(m.num_layers):
        t, b = f"transformer.h.{i}.", f"blocks.{i}."
        rows = list(theirs.pop(t + "attn.c_attn.weight").split(d, dim=0))
        names = ([f"attn.{export_to_reference[q]}" for q, their in query.items() if their == "c_attn.q"]
                 + ["attn.k.weight", "attn.v.weight"])  # fmt: skip
        if len(rows) != len(names):
            raise UsageError(f"{t}attn.c_attn.weight: {len(rows)} blocks of rows, arm {arm.name} expects {len(names)}")
        own |= {b + n: r for n, r in zip(names, rows)}
        own |= {
            b + "ln1.weight": theirs.pop(t + "ln_1.weight"), b + "ln2.weight": theirs.pop(t + "ln_2.weight"),
            b + "mlp.up.weight": theirs.pop(t + "mlp.c_fc.weight"),
            b + "mlp.down.weight": theirs.pop(t + "mlp.c_proj.weight"),
            b + "attn.proj.weight": theirs.pop(t + "attn.c_proj.weight"),
        }  # fmt: skip
        for ours, their in query.items():
            if their != "c_attn.q":
                own[f"{b}attn.{export_to_reference[ours]}"] = theirs.pop(f"{t}attn.{their}")
    left = [k for k in theirs if not k.endswith(".attn.bias")]  # old nanoGPT's causal-mask buffer
    if left:
        raise UsageError(f"{left[0]}: not a weight of the {arm.nanogpt_mode} query mode ({len(left)} left over)")
    return own


def import_checkpoint(path: Path, run_dir: Path, mode: str | None, heads: int | None) -> Path:
    """Their checkpoint as `run_dir` (which must not exist or be empty); returns the checkpoint dir."""
    from megatron.core import dist_checkpointing

    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.model.gpt import build_gpt, seed_init
    from nlq_scale.model.reference import ReferenceGPT, load_into_megatron
    from nlq_scale.runtime.dist import distributed
    from nlq_scale.train.checkpoint import CheckpointDir
    from nlq_scale.train.rundir import claim

    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UsageError(f"--out {run_dir}: exists and is not an empty directory (nothing overwritten)")
    state, model_args, step = read_authors_checkpoint(path)
    arm = arm_for_mode(_mode(model_args, mode, path))
    cfg = authors_run_config(state, model_args, arm, heads, path)
    ref = ReferenceGPT(cfg.model)
    try:
        ref.load_state_dict(reference_state(state, cfg, arm), strict=True)
    except RuntimeError as e:
        detail = str(e).splitlines()[-1].strip()
        raise UsageError(f"{path}: weights do not fit the {arm.nanogpt_mode} mode ({detail})") from None
    with distributed(ParallelConfig(), device="cpu"):
        seed_init(cfg.seed)
        model = build_gpt(cfg.model, cfg.parallel, device=torch.device("cpu"))
        load_into_megatron(model, ref)
        claim(run_dir, cfg)
        trainer_state = {"step": step, "imported_from": str(path.resolve()), "world_size": 1}
        return CheckpointDir(run_dir, keep=1).save(
            step, 0, lambda tmp: dist_checkpointing.save(model.sharded_state_dict(), str(tmp)), trainer_state
        )
