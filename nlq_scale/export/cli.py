"""`nlq-scale export` (a checkpoint as a transformers directory), `nlq-scale generate`, and
`nlq-scale import-nanogpt` (the nonlinear-query authors' checkpoints as a run directory)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nlq_scale.errors import UsageError, check_creatable
from nlq_scale.files import staged_dir

FORMATS = ("hf",)


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run's checkpoint as a Hugging Face transformers directory")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--format", choices=FORMATS, default="hf")
    p.add_argument("--out", type=Path, required=True, help="a new or empty directory")
    p.set_defaults(func=run_export)

    g = sub.add_parser("generate", help="decode from a run's checkpoint or an export directory (greedy by default)")
    g.add_argument("source", type=Path, metavar="RUN_DIR|EXPORT_DIR")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="the most likely token at each step (the default)")
    mode.add_argument("--temperature", type=float, help="sample at this temperature")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens (with --temperature)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--step", type=int, help="run directory only: checkpoint step (default: the newest)")
    g.add_argument("--json", action="store_true", help='{"prompt_ids", "output_ids" (new tokens), "text"}')
    g.set_defaults(func=run_generate)

    i = sub.add_parser("import-nanogpt", help="the nonlinear-query authors' nanoGPT checkpoint as a run directory")
    i.add_argument("checkpoint", type=Path, metavar="CKPT", help="their ckpt.pt (or a bare state dict file)")
    i.add_argument("--out", type=Path, required=True, help="the run directory to create (new or empty)")
    i.add_argument("--mode", help="their query mode (default: model_args.query_mode in the checkpoint)")
    i.add_argument("--heads", type=int, help="attention heads (default: model_args.n_head in the checkpoint)")
    i.set_defaults(func=run_import)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out}: exists and is not an empty directory (nothing overwritten)")


def run_export(args: argparse.Namespace) -> int:
    from nlq_scale.export.checkpoint import find_checkpoint
    from nlq_scale.export.hf import export_checkpoint, stock_class

    _check_out(args.out)
    check_creatable(args.out, "--out")
    ckpt = find_checkpoint(args.run_dir, args.step)
    # Written beside --out and renamed into place: a failed export leaves no half directory.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(args.out) as tmp:  # an existing --out is empty, checked above
        model = export_checkpoint(ckpt, tmp)
    kind = stock_class(ckpt.cfg.model) or "remote code (trust_remote_code=True)"
    print(f"exported {ckpt.path} -> {args.out} ({type(model).__name__}, {kind})")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json
    from nlq_scale.export import generate
    from nlq_scale.train.rundir import CONFIG_FILE

    if args.top_k is not None and args.temperature is None:
        raise UsageError("--top-k: needs --temperature (greedy decoding takes the top token)")
    sampling = generate.Sampling(args.temperature, args.top_k, args.seed)
    sampling.check()
    if (args.source / CONFIG_FILE).is_file():
        result = generate.from_run(args.source, args.step, args.prompt, args.max_new_tokens, sampling)
    elif (args.source / "config.json").is_file():
        if args.step is not None:
            raise UsageError("--step: only for a run directory (an export holds one checkpoint)")
        result = generate.from_export(args.source, args.prompt, args.max_new_tokens, sampling)
    else:
        raise UsageError(f"{args.source}: neither a run directory (config.yaml) nor an export (config.json)")
    if args.json:
        emit_json(result)
    else:
        print(args.prompt + result["text"])
    return 0


def run_import(args: argparse.Namespace) -> int:
    from nlq_scale.export.nanogpt import import_checkpoint

    check_creatable(args.out, "--out")
    ckpt = import_checkpoint(args.checkpoint, args.out, args.mode, args.heads)
    print(f"imported {args.checkpoint} -> {ckpt} (export it with: nlq-scale export {args.out} --out DIR)")
    return 0
