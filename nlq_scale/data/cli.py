"""`nlq-scale prepare-data`: raw corpus -> deterministic MDS shards + manifest (see docs/data.md).

Kept light: the tokenizer, pyarrow and mosaicml-streaming are imported inside the handler.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from nlq_scale.errors import UsageError, check_creatable

SOURCES = ("openwebtext", "pile", "text", "jsonl")
SAMPLE_VAL_FRACTION = 0.1  # the sample corpus is small: a tenth is still ~100k tokens


def _mib(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MiB: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return int(value * (1 << 20))


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare-data",
        help="tokenize a corpus (OpenWebText, The Pile, txt, jsonl) into deterministic MDS shards",
        description="Tokenize a corpus with GPT-2 BPE, pack documents (joined by EOT) into windows of "
        "seq_len+1 tokens and write mosaicml-streaming MDS shards plus DIR/manifest.json. The same "
        "inputs and options give byte-identical output.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--input", nargs="+", metavar="PATH", help="input files or directories (read in sorted order)")
    what.add_argument("--sample", action="store_true",
                      help="use the built-in sample corpus (Pile-format .jsonl.zst of Python/NumPy/Matplotlib docs)")
    what.add_argument("--merge", type=Path, metavar="DIR",
                      help="join the parts in DIR.parts/ (from --part I/N) into the dataset DIR")
    p.add_argument("--source", choices=SOURCES, help="input format (implied 'pile' with --sample)")
    p.add_argument("--out", type=Path, metavar="DIR", help="output dataset directory (required unless --merge)")
    parallel = p.add_mutually_exclusive_group()
    parallel.add_argument("--part", metavar="I/N",
                          help="prepare only part I of N (the inputs cut into N consecutive stretches) into DIR.parts/")
    parallel.add_argument("--parts", type=int, metavar="N",
                          help="with --executor: run all N parts (then the merge) on SLURM or on this machine")
    p.add_argument("--executor", choices=("slurm", "local"),
                   help="where --parts run: slurm (a job array and a dependent merge job, through submitit) "
                   "or local (N processes here sharing --workers, then the merge)")
    p.add_argument("--cluster", help="with --executor: cluster file or name in configs/clusters (e.g. local-slurm)")
    p.add_argument("--keep-parts", action="store_true", help="--merge: keep DIR.parts/ after merging")
    p.add_argument("--seq-len", type=int, default=1024, help="model sequence length; windows hold seq_len+1 tokens")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-docs", type=int, metavar="N", help="validation split = the N documents with the smallest text hash")
    val.add_argument("--val-fraction", type=float, metavar="F",
                     help="validation split = documents whose text hash falls in the first F of the hash space "
                     f"(default 0.0005; {SAMPLE_VAL_FRACTION} with --sample)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer threads, or --merge's shard-writing processes (default: all cores)")
    p.add_argument("--force", action="store_true", help="replace an existing, different dataset in DIR")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip (and count in the manifest) bad documents: invalid JSON, non-UTF-8, empty, truncated files")
    p.add_argument("--text-field", default="text", help="jsonl: the (dotted) field holding the text")
    p.add_argument("--pile-sets", metavar="NAMES", help="pile/jsonl: keep only these comma-separated meta.pile_set_name values")
    p.add_argument("--compression", choices=("none", "zstd"), default="none",
                   help="shard compression; zstd shards are decompressed beside themselves on first read")
    p.add_argument("--shard-size", type=_mib, default=64 << 20, metavar="MIB", help="shard size limit in MiB (default 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    p.set_defaults(func=run_prepare)


def _options(args: argparse.Namespace, inputs: list[Path], source: str):
    from pydantic import ValidationError

    from nlq_scale.data.prepare import PrepareOptions

    fields = {
        "source": source,
        "inputs": inputs,
        "out": args.out,
        "seq_len": args.seq_len,
        "val_docs": args.val_docs,
        "val_fraction": args.val_fraction,
        "workers": args.workers,
        "force": args.force,
        "skip_bad": args.skip_bad,
        "text_field": args.text_field,
        "pile_sets": [s.strip() for s in args.pile_sets.split(",") if s.strip()] if args.pile_sets else None,
        "compression": args.compression,
        "shard_bytes": args.shard_size,
    }
    try:
        return PrepareOptions(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        name = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-") if err["loc"] else "prepare-data"
        raise UsageError(f"{name}: {err['msg']}") from None


def _check_parallel(args: argparse.Namespace) -> None:
    if args.merge is not None:
        if args.out is not None or args.part or args.parts:
            raise UsageError("--merge DIR: takes everything from the parts; give no --out, --part or --parts")
        return
    if args.out is None:
        raise UsageError("--out is required with --input or --sample")
    check_creatable(args.out, "--out")
    if (args.parts is None) != (args.executor is None):
        raise UsageError("--parts N and --executor go together (run one part here with --part I/N)")
    if args.executor == "slurm" and args.cluster is None:
        raise UsageError("--executor slurm: --cluster CLUSTER is required (a file or a name in configs/clusters)")
    if args.parts is not None and args.parts < 1:
        raise UsageError(f"--parts {args.parts}: must be at least 1")
    if args.executor == "slurm" and args.sample:
        raise UsageError("--sample with --executor slurm: the sample corpus lives only as long as this process; "
                         "write it with nlq_scale.data.sample.sample_corpus and pass --input")


def _run(args: argparse.Namespace, opts) -> dict:
    """Prepare the whole dataset here, one part of it, or submit the parts and their merge."""
    if args.part:
        from nlq_scale.data.parts import parse_part, prepare_part

        return prepare_part(opts, *parse_part(args.part), progress=not args.no_progress)
    if args.executor == "local":
        from nlq_scale.data.submit import run_locally

        return run_locally(opts, args.parts, keep_parts=args.keep_parts)
    if args.executor == "slurm":
        from nlq_scale.data.submit import submit_parts

        return submit_parts(opts, args.parts, args.cluster, keep_parts=args.keep_parts)
    from nlq_scale.data.prepare import prepare

    return prepare(opts, progress=not args.no_progress)


def run_prepare(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json

    _check_parallel(args)
    if args.merge is not None:
        from nlq_scale.data.parts import merge_parts

        summary = merge_parts(args.merge, force=args.force, keep_parts=args.keep_parts, progress=not args.no_progress,
                              workers=args.workers)
    elif args.sample:
        if args.source not in (None, "pile"):
            raise UsageError("--sample is a Pile-format corpus: use --source pile or leave --source out")
        if args.val_docs is None and args.val_fraction is None:
            args.val_fraction = SAMPLE_VAL_FRACTION
        summary = _prepare_sample(args)
    else:
        if args.source is None:
            raise UsageError("--source is required with --input")
        summary = _run(args, _options(args, [Path(p) for p in args.input], args.source))
    if args.json:
        emit_json(summary)
    else:
        print(_describe(summary))
    return 0


def _describe(summary: dict) -> str:
    if "splits" in summary:
        counts = ", ".join(f"{s}: {v['sequences']} sequences / {v['tokens']} tokens" for s, v in summary["splits"].items())
        return f"{summary['out']}: {summary['outcome']} ({counts}; skipped {summary['skipped']})"
    if "part" in summary:
        return (f"{summary['out']}: part {summary['part']} {summary['outcome']} ({summary['documents']} documents / "
                f"{summary['tokens']} tokens; skipped {summary['skipped']})")
    return (f"{summary['out']}: {summary['parts']} parts submitted as job array {summary['parts_job']}, "
            f"merge as job {summary['merge_job']} (logs: {summary['logs']})")


def _prepare_sample(args: argparse.Namespace) -> dict:
    from nlq_scale.data.sample import sample_corpus

    src = args.out.parent / f".{args.out.name}.sample-src-{os.getpid()}"
    try:
        inputs = sample_corpus(src)
        return _run(args, _options(args, inputs, "pile"))
    finally:
        shutil.rmtree(src, ignore_errors=True)
