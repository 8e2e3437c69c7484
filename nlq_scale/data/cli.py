"""`nlq-scale prepare-data`: raw corpus -> deterministic MDS shards + manifest (see docs/data.md).

Kept light: the tokenizer, pyarrow and mosaicml-streaming are imported inside the handler.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from nlq_scale.errors import UsageError

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
    p.add_argument("--source", choices=SOURCES, help="input format (implied 'pile' with --sample)")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output dataset directory")
    p.add_argument("--seq-len", type=int, default=1024, help="model sequence length; windows hold seq_len+1 tokens")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-docs", type=int, metavar="N", help="validation split = the N documents with the smallest text hash")
    val.add_argument("--val-fraction", type=float, metavar="F",
                     help="validation split = documents whose text hash falls in the first F of the hash space "
                     f"(default 0.0005; {SAMPLE_VAL_FRACTION} with --sample)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer threads (default: all cores)")
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


def run_prepare(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json
    from nlq_scale.data.prepare import prepare

    if args.sample:
        if args.source not in (None, "pile"):
            raise UsageError("--sample is a Pile-format corpus: use --source pile or leave --source out")
        if args.val_docs is None and args.val_fraction is None:
            args.val_fraction = SAMPLE_VAL_FRACTION
        summary = _prepare_sample(args)
    else:
        if args.source is None:
            raise UsageError("--source is required with --input")
        summary = prepare(_options(args, [Path(p) for p in args.input], args.source), progress=not args.no_progress)
    if args.json:
        emit_json(summary)
    else:
        counts = ", ".join(f"{s}: {v['sequences']} sequences / {v['tokens']} tokens" for s, v in summary["splits"].items())
        print(f"{summary['out']}: {summary['outcome']} ({counts}; skipped {summary['skipped']})")
    return 0


def _prepare_sample(args: argparse.Namespace) -> dict:
    from nlq_scale.data.prepare import prepare
    from nlq_scale.data.sample import sample_corpus

    src = args.out.parent / f".{args.out.name}.sample-src-{os.getpid()}"
    try:
        inputs = sample_corpus(src)
        return prepare(_options(args, inputs, "pile"), progress=not args.no_progress)
    finally:
        shutil.rmtree(src, ignore_errors=True)
