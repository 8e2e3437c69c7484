"""Stand-in for the programs a documented shell block calls (`nlq-scale`, `make`, `pip`, `torchrun`, `python`),
put first on PATH by tests/test_docs_commands.py. Each runs the real program, cheaply:

- nlq-scale: the command line is parsed by the real parser first (so a renamed option or command fails);
  then `submit` runs with `--dry-run` (what it would queue, with every check it makes before queueing;
  with a 16-sequence validation set unless the command sets one, since stand-in data cannot hold a GPU scale's),
  `train` for 2 steps, `prepare-data` of a stand-in corpus with a validation split that holds something, `status`/`compare` of a sweep that was only dry-run submitted are parsed only
  (nothing trained there), `doctor --train` is parsed only (minutes of training per arm); all else runs as written.
- make: `make -n` (the recipe must exist and expand).
- pip: install with `--dry-run --no-deps --no-index --no-build-isolation`; wheel builds the project's
  own wheel only; a named extra the project lacks fails.
- python: runs as written.
- torchrun: the script runs for real in 1 process (a 2-core machine), with the given arguments.

$DOC_SHIM_DIR is the directory of the stand-ins (skipped when the real program is looked up). Every call appends {"argv", "mode", "rc"} to $DOC_SHIM_LOG; a line's failure fails the test even where the
shell does not notice (background jobs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

DRY_ROOTS = "DOC_SHIM_DRY_ROOTS"  # file: sweep dirs that a dry-run submit named, one a line
STAND_IN_VAL_SEQUENCES = 16


def _log(argv: list[str], mode: str, rc: int) -> int:
    with open(os.environ["DOC_SHIM_LOG"], "a") as f:
        f.write(json.dumps({"argv": argv, "mode": mode, "rc": rc}) + "\n")
    return rc


def _real(program: str) -> str:
    """The program on PATH after the shim's own directory."""
    shim_dir = str(Path(os.environ["DOC_SHIM_DIR"]).resolve())
    rest = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if str(Path(p).resolve()) != shim_dir)
    found = shutil.which(program, path=rest)
    if found is None:
        sys.exit(f"doc_shim: {program} not found")
    return found


def _dry_roots() -> set[str]:
    path = Path(os.environ[DRY_ROOTS])
    return set(path.read_text().splitlines()) if path.exists() else set()


def nlq_scale(argv: list[str]) -> tuple[str, int]:
    from nlq_scale.cli import build_parser, main

    args = build_parser().parse_args(argv)  # exits 2 on a documented option that no longer exists
    if args.command == "submit":
        argv = [*argv, "--json"] + ([] if args.dry_run else ["--dry-run"])
        if not any(a.startswith("data.val_") for a in argv):
            # A GPU scale validates on 8192 sequences; a stand-in corpus's val split holds a few hundred.
            argv.append(f"data.val_sequences={STAND_IN_VAL_SEQUENCES}")
        out = subprocess.run([sys.executable, "-m", "nlq_scale.cli", *argv], capture_output=True, text=True)
        sys.stderr.write(out.stderr)
        if out.returncode == 0:
            runs = json.loads(out.stdout)["runs"]
            with open(os.environ[DRY_ROOTS], "a") as f:
                f.writelines(f"{Path(r['run_dir']).parent}\n" for r in runs)
        return "dry-run", out.returncode
    if args.command in ("status", "compare"):
        targets = [args.root] if args.command == "status" else args.roots
        if all(not Path(t).exists() and str(Path(t).resolve()) in _dry_roots() for t in targets):
            return "parsed (sweep submitted with --dry-run)", 0
    if args.command == "doctor" and args.train:
        return "parsed (trains every arm)", 0
    if args.command == "prepare-data" and not (args.sample or args.merge or args.val_docs):
        # The stand-in corpus has ~1k documents: a fraction meant for millions (0.05-0.4 %) would hold none.
        if args.val_fraction:
            i = argv.index("--val-fraction")
            argv = [*argv[:i], *argv[i + 2:]]
        return "real, --val-fraction 0.4", main([*argv, "--val-fraction", "0.4"])
    if args.command == "train":
        return "real, 2 steps", main([*argv, "train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "checkpoint.every=2"])
    return "real", main(argv)


def make(argv: list[str]) -> tuple[str, int]:
    return "make -n", subprocess.run([_real("make"), "-n", *argv]).returncode


def pip(argv: list[str]) -> tuple[str, int]:
    verb, *rest = argv
    offline = ["--no-deps", "--no-index", "--no-build-isolation"]
    extra = {"install": ["--dry-run", *offline], "wheel": offline}[verb]
    out = subprocess.run([sys.executable, "-m", "pip", verb, *extra, *rest], capture_output=True, text=True)
    sys.stderr.write(out.stdout + out.stderr)
    if "does not provide the extra" in out.stderr:
        return f"pip {verb} (offline)", 1
    return f"pip {verb} (offline)", out.returncode


def torchrun(argv: list[str]) -> tuple[str, int]:
    i = argv.index("--nproc-per-node")
    argv = [*argv[:i], "--nproc-per-node", "1", *argv[i + 2:]]
    return "real, 1 process", subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv]).returncode


def python(argv: list[str]) -> tuple[str, int]:
    return "real", subprocess.run([sys.executable, *argv]).returncode


def main() -> int:
    program, *argv = sys.argv[1:]
    try:
        mode, rc = {"nlq-scale": nlq_scale, "make": make, "pip": pip, "torchrun": torchrun, "python": python}[program](argv)
    except SystemExit as e:  # argparse's exit on a bad command line
        mode, rc = "parse", e.code if isinstance(e.code, int) else 1
    return _log([program, *argv], mode, rc)


if __name__ == "__main__":
    sys.exit(main())
