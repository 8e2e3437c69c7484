"""A small real English corpus for the quickstart and the tests, derived on first use from text that
is installed anyway, written in The Pile's own format (`.jsonl.zst`, several zstd frames without a
content size, `{"text": ..., "meta": {"pile_set_name": ...}}`).

Sources and licences (the text is derived locally and never redistributed by this project):
- Python's `pydoc_data.topics` (the language reference topics behind `help()`), PSF License;
- docstrings of the Python standard library, PSF License;
- docstrings of NumPy (BSD-3-Clause) and Matplotlib (Matplotlib License, BSD-style), both
  dependencies of nlq-scale.
About 4.9 MB of text, ~1.1 M GPT-2 tokens. Source files are parsed with `ast` (nothing is
imported), in sorted order, so the output is a function of the installed versions, which each
record's `meta` names.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import platform
import sysconfig
import warnings
from collections import deque
from collections.abc import Iterator
from pathlib import Path

FRAME_BYTES = 1 << 20
ZSTD_LEVEL = 3
MAX_DOC_CHARS = 16_000
SKIP_PARTS = {"test", "tests", "testing", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages",
              "dist-packages", "_vendor", "vendored"}
DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
STATEMENT_NODES = (ast.stmt, ast.excepthandler, ast.match_case)


def _pydoc_topics() -> Iterator[dict]:
    from pydoc_data.topics import topics

    meta = {"pile_set_name": "pydoc topics", "source": f"Python {platform.python_version()}", "license": "PSF-2.0"}
    for name in sorted(topics):
        yield {"text": topics[name].strip() + "\n", "meta": {**meta, "topic": name}}


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """ast.walk's breadth-first order, over the statements only (and the except/case clauses that
    hold some): a docstring's owner is always a statement, and expressions are most of a tree."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, STATEMENT_NODES))
        yield node


def _docstrings(path: Path) -> list[str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old escape sequences in some sources
            tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in _statements(tree):
        if isinstance(node, DOC_NODES):
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                title = "" if isinstance(node, ast.Module) else f"{node.name}\n\n"
                out.append(title + doc.strip())
    return out


def _documents_of(parts: list[str]) -> Iterator[str]:
    """A module's docstrings, cut at docstring boundaries into documents of at most ~MAX_DOC_CHARS."""
    doc: list[str] = []
    size = 0
    for part in parts:
        if doc and size + len(part) > MAX_DOC_CHARS:
            yield "\n\n".join(doc) + "\n"
            doc, size = [], 0
        doc.append(part)
        size += len(part)
    if doc:
        yield "\n\n".join(doc) + "\n"


def _package_docstrings(root: Path, set_name: str, source: str, license: str) -> Iterator[dict]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS.intersection(rel.parts):
            continue
        for doc in _documents_of(_docstrings(path)):
            yield {"text": doc, "meta": {"pile_set_name": set_name, "source": source, "module": rel.as_posix(),
                                         "license": license}}


def _package_root(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{name} is not installed")
    return Path(spec.origin).parent


def _sets() -> list[tuple[str, Iterator[dict]]]:
    python = f"Python {platform.python_version()}"
    return [
        ("pydoc-topics", _pydoc_topics()),
        ("python-stdlib", _package_docstrings(Path(sysconfig.get_paths()["stdlib"]), "Python stdlib docstrings",
                                              python, "PSF-2.0")),
        ("numpy", _package_docstrings(_package_root("numpy"), "NumPy docstrings",
                                      f"numpy {importlib.metadata.version('numpy')}", "BSD-3-Clause")),
        ("matplotlib", _package_docstrings(_package_root("matplotlib"), "Matplotlib docstrings",
                                           f"matplotlib {importlib.metadata.version('matplotlib')}",
                                           "Matplotlib License (BSD-style)")),
    ]


def _write_pile_file(path: Path, records: Iterator[dict]) -> None:
    """One zstd frame per ~1 MiB of lines, no content size in the frame headers, as in The Pile."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=False, threads=0)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        frame: list[bytes] = []
        size = 0
        for record in records:
            line = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
            frame.append(line)
            size += len(line)
            if size >= FRAME_BYTES:
                f.write(compressor.compress(b"".join(frame)))
                frame, size = [], 0
        if frame:
            f.write(compressor.compress(b"".join(frame)))
    tmp.replace(path)


def sample_corpus(out_dir: str | Path) -> list[Path]:
    """Write the sample corpus as `NN-<set>.jsonl.zst` files into out_dir; returns their paths.
    Prepare it with `nlq-scale prepare-data --sample ...` (or `--source pile --input` these files)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, (name, records) in enumerate(_sets()):
        path = out / f"{number:02d}-{name}.jsonl.zst"
        _write_pile_file(path, records)
        paths.append(path)
    return paths
