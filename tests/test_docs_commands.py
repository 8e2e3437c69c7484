"""Every shell command in README.md and docs/*.md runs, so a doc that drifts from the code fails here.

Shell blocks are fenced ```bash and run as written (globs, loops, `&`), each in a scratch directory
of its own (a doc's blocks are often alternatives) that holds the repository's files and the inputs
the docs name, made from the bundled sample corpus.
tests/doc_shim.py stands in for nlq-scale, make, pip, torchrun and python and keeps each cheap: real where it
is cheap, `--dry-run`/`make -n`/parse-only where it would train a GPU model or install. Usage
synopses are fenced ```text; the options they name must exist. Unlabelled fences are refused, so a
command cannot hide from this test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import pytest

from tests.conftest import REPO, nlq

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
SHIM_PROGRAMS = ("nlq-scale", "make", "pip", "torchrun", "python")
# What the repository root gives a documented command (relative paths in the docs start there).
REPO_ENTRIES = ("configs", "launch", "slurm", "nlq_scale", "pyproject.toml", "Makefile", "constraints.txt", "README.md")
# Blocks not run here, by their first line, and where they are run instead.
NOT_RUN = {
    "slurm/local-cluster/start.sh": "starts a root SLURM cluster; tests/test_cluster_slurm.py runs it",
}
QUICKSTART_DATA = "runs/quickstart/data/sample-64"
TWO_STEPS = ("train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "checkpoint.every=2")
FAST_DOCS = {"README.md", "gpu.md"}  # < 20 s on 2 cores; the others prepare data or train (a new doc: slow)


def fences(path: Path) -> list[tuple[int, str, str]]:
    """(line, language, body dedented) of every fenced block, also those indented in list items."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        indent = len(m["indent"])
        body = "".join(line[indent:] for line in m["body"].splitlines(keepends=True))
        out.append((text.count("\n", 0, m.start()) + 1, m["lang"], body))
    return out


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    return [(line, body) for line, lang, body in fences(path) if lang == "bash"]


def test_every_fence_names_its_language():
    unlabelled = [f"{p.relative_to(REPO)}:{line}" for p in DOCS for line, lang, _ in fences(p) if not lang]
    assert not unlabelled, f"fence without a language (bash: run by this test; text: not a command): {unlabelled}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> Iterator[str]:
    """GitHub's heading ids: lower case, punctuation but - and _ dropped, spaces to -, repeats -1, -2."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        yield slug if n == 0 else f"{slug}-{n}"


def test_links_between_pages_resolve():
    """Every relative link of the README and docs/ names a file that exists, and its #anchor a heading
    of that page."""
    checked = anchored = 0
    for page in DOCS:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http(s), mailto
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in set(anchors(dest)), f"{page.name}: {target}"
                anchored += 1
            checked += 1
    assert checked > 40 and anchored > 5, (checked, anchored)  # the pattern finds the links


def test_documented_commands_use_known_programs():
    """A command in a bash block is one the shim runs (or a block listed in NOT_RUN)."""
    for path in DOCS:
        for line, body in shell_blocks(path):
            first = body.splitlines()[0].split("#")[0].strip()
            if first in NOT_RUN:
                continue
            for cmd in _commands(body):
                assert cmd in SHIM_PROGRAMS, f"{path.relative_to(REPO)}:{line}: {cmd!r} is not run by tests/doc_shim.py"


def _commands(body: str) -> list[str]:
    """The program of each simple command in a block (after `do`, `;`, `&&`, `&`, a newline); a
    here-document is the command's input, not commands."""
    body = re.sub(r"<<-?'?(\w+)'?\n.*?^\1$", "", body, flags=re.M | re.S)
    code = "\n".join(line.split(" #")[0] for line in body.splitlines() if not line.lstrip().startswith("#"))
    words = [w.split()[0] for w in re.split(r"\n|;|&&|\|\||&|\bdo\b", code) if w.strip()]
    return [w for w in words if w not in ("for", "done", "wait", "then", "fi")]


def _subcommand_options() -> dict[str, set[str]]:
    from nlq_scale.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def test_usage_synopses_name_existing_options():
    options = _subcommand_options()
    for path in DOCS:
        for line, lang, body in fences(path):
            if lang != "text":
                continue
            command = None
            for text in body.splitlines():
                m = re.match(r"nlq-scale (\S+)", text)
                if m:
                    command = m[1]
                    assert command in options, f"{path.relative_to(REPO)}:{line}: no command {command!r}"
                elif not text.startswith(" "):
                    command = None  # a listing, not a synopsis
                if command:
                    for opt in re.findall(r"(?<![\w-])--[a-z][a-z-]*", text):
                        assert opt in options[command], f"{path.relative_to(REPO)}:{line}: {command} has no {opt}"


# ---------------------------------------------------------------- running the shell blocks


def _pile_texts(paths: list[Path]) -> list[str]:
    import io

    import zstandard

    texts = []
    for path in paths:
        with open(path, "rb") as f:
            reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True))
            texts += [json.loads(line)["text"] for line in reader]
    return texts


class DocInputs:
    """The inputs the docs name: the session's prepared sample, and, made on first use, the raw corpus in
    every distribution format the docs show (from the bundled sample) and the other prepared datasets."""

    def __init__(self, base: Path, sample_64: Path):
        self.base = base
        self.sample_64 = sample_64  # the session's prepared sample: conftest's sample_dataset

    @cached_property
    def texts(self) -> list[str]:
        """The sample corpus' documents."""
        from nlq_scale.data.sample import sample_corpus

        return _pile_texts(sample_corpus(self.base / "sample-corpus"))

    @cached_property
    def pile(self) -> Path:
        """pile/train/NN.jsonl.zst as the Pile ships them, with its set names (for --pile-sets)."""
        from tests.test_data_helpers import write_pile

        out = self.base / "pile" / "train"
        out.mkdir(parents=True)
        half = len(self.texts) // 2
        for i, docs in enumerate((self.texts[:half], self.texts[half:])):
            write_pile(out / f"{i:02d}.jsonl.zst", docs, sets=["Pile-CC", "OpenWebText2", "Github", "ArXiv"])
        return self.base / "pile"

    @cached_property
    def owt_parquet(self) -> Path:
        """A directory of OpenWebText parquet shards (Hugging Face's layout)."""
        from tests.test_data_helpers import write_parquet

        out = self.base / "owt-parquet"
        out.mkdir()
        write_parquet(out / "train-00000-of-00001.parquet", self.texts)
        return out

    @cached_property
    def owt_tar(self) -> Path:
        """openwebtext.tar.xz as distributed: an xz tar of xz tars of .txt documents."""
        from tests.test_data_helpers import write_owt_tar

        return write_owt_tar(self.base / "openwebtext.tar.xz", self.texts)

    @cached_property
    def owt_1024(self) -> Path:
        """What docs/slurm.md calls data/owt-1024, with a validation split large enough for paper-124m's
        480 validation sequences."""
        return self._prepare("owt-1024", "--source", "openwebtext", "--input", str(self.owt_parquet),
                             "--seq-len", "1024", "--val-fraction", "0.4")

    @cached_property
    def trained_run(self) -> Path:
        """A real run with metrics (2 steps of cpu-xs), for the docs' `run_a/metrics.jsonl` examples."""
        out = self.base / "trained"
        r = nlq("train", "--scale", "cpu-xs", "--arm", "linear", "--run-dir", str(out),
                f"data.path={self.sample_64}", *TWO_STEPS)
        assert r.returncode == 0, r.stderr
        return out

    @cached_property
    def run_yaml(self) -> Path:
        shown = nlq("config", "show", "--scale", "cpu-xs", "--arm", "nonlinear", f"data.path={self.sample_64}",
                    *TWO_STEPS)
        assert shown.returncode == 0, shown.stderr
        (self.base / "run.yaml").write_text(shown.stdout)
        return self.base / "run.yaml"

    def _prepare(self, name: str, *args: str) -> Path:
        out = self.base / name
        r = nlq("prepare-data", *args, "--out", str(out), "--no-progress")
        assert r.returncode == 0, r.stderr
        return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, sample_dataset) -> DocInputs:
    return DocInputs(tmp_path_factory.mktemp("doc-inputs"), sample_dataset)


def _workdir(tmp: Path, inputs: DocInputs, doc_text: str) -> Path:
    work = tmp / "work"
    (work / "data").mkdir(parents=True)
    for name in REPO_ENTRIES:
        (work / name).symlink_to(REPO / name)
    links = {"pile": lambda: inputs.pile, "openwebtext.tar.xz": lambda: inputs.owt_tar,
             "openwebtext/plain_text": lambda: inputs.owt_parquet, "data/owt": lambda: inputs.owt_parquet}
    for name, made in links.items():
        if re.search(rf"(?<![\w-]){re.escape(name)}/", doc_text) or name.endswith(".xz") and name in doc_text:
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).symlink_to(made())
    if "data/owt-1024" in doc_text and "--out data/owt-1024" not in doc_text:
        (work / "data" / "owt-1024").symlink_to(inputs.owt_1024)
    if QUICKSTART_DATA in doc_text:  # what `make quickstart` leaves behind, for the sweeps that train on it
        (work / QUICKSTART_DATA).parent.mkdir(parents=True)
        (work / QUICKSTART_DATA).symlink_to(inputs.sample_64)
    return work


# The docs' placeholders and absolute example paths -> where they are made real (work: the scratch directory).
PLACEHOLDERS = {
    r"(?<![\w/])/data/": lambda work, inputs: f"{work}/data/",
    r"(?<![\w/])/scratch/": lambda work, inputs: f"{work}/scratch/",
    r"\bDATA\b": lambda work, inputs: str(inputs.sample_64),
    r"\bRUN\.yaml\b": lambda work, inputs: str(inputs.run_yaml),
    r"\bDIR\b": lambda work, inputs: str(work / "runs" / "by-hand"),
    r"\brun_[ab]/": lambda work, inputs: f"{inputs.trained_run}/",
}


def _doc_param(path: Path):
    marks = [] if path.name in FAST_DOCS else [pytest.mark.slow]
    return pytest.param(path, id=str(path.relative_to(REPO)), marks=marks)


@pytest.mark.parametrize("doc", [_doc_param(p) for p in DOCS if shell_blocks(p)])
def test_shell_blocks_run(doc: Path, tmp_path, inputs: DocInputs):
    shim = tmp_path / "shim"
    shim.mkdir()
    for program in SHIM_PROGRAMS:
        (shim / program).write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/doc_shim.py" {program} "$@"\n')
        (shim / program).chmod(0o755)
    log = tmp_path / "shim.jsonl"
    env = os.environ | {
        "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "DOC_SHIM_LOG": str(log),
        "DOC_SHIM_DIR": str(shim),
        "DOC_SHIM_DRY_ROOTS": str(tmp_path / "dry-roots"),
    }
    for line, body in shell_blocks(doc):
        where = f"{doc.relative_to(REPO)}:{line}"
        first = body.splitlines()[0].split("#")[0].strip()
        if first in NOT_RUN:
            for script in _commands(body):
                if "/" in script:
                    assert (REPO / script).is_file(), f"{where}: {script} does not exist"
            assert subprocess.run(["bash", "-n", "-c", body]).returncode == 0, f"{where}: not valid bash"
            continue
        work = _workdir(tmp_path / f"line-{line}", inputs, doc.read_text())  # blocks are alternatives, not steps
        for pattern, value in PLACEHOLDERS.items():
            if re.search(pattern, body):
                body = re.sub(pattern, value(work, inputs), body)
        calls_before = _calls(log)
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=work, env=env, capture_output=True,
                             text=True, timeout=900)
        calls = _calls(log)[len(calls_before):]
        failed = [c for c in calls if c["rc"] != 0]
        assert out.returncode == 0 and not failed, f"{where}: exit {out.returncode}, failed {failed}\n{out.stderr[-3000:]}"
        assert calls, f"{where}: ran no command"


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []



