"""Small corpora in each real distribution format, generated in the tests (imported by the other
test_data_* modules), plus checks that the generated files have the real formats' structure."""

from __future__ import annotations

import io
import json
import lzma
import tarfile
from pathlib import Path

import pytest
import zstandard

OWT_INNER = "openwebtext/urlsf_subset00-1_data.xz"


def documents(count: int | None = None) -> list[str]:
    """Real English: paragraphs of Python's language-reference topics (pydoc_data), in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            if len(para.strip()) > 80:
                out.append(para.strip() + "\n")
    return out if count is None else out[:count]


def _tar_bytes(members: dict[str, bytes], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_owt_tar(path: Path, docs: list[str], inner_archives: int = 2) -> Path:
    """openwebtext.tar.xz: an xz tar of `urlsf_subset*.xz` files, each an xz tar of `.txt` documents."""
    inner = {}
    per = -(-len(docs) // inner_archives)
    for a in range(inner_archives):
        txts = {f"{a:07d}-{i:05d}.txt": d.encode() for i, d in enumerate(docs[a * per : (a + 1) * per])}
        inner[f"openwebtext/urlsf_subset{a:02d}-1_data.xz"] = _tar_bytes(txts, "w:xz")
    path.write_bytes(_tar_bytes(inner, "w:xz"))
    return path


def write_parquet(path: Path, docs: list[str], row_group_size: int = 50) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), path, row_group_size=row_group_size)
    return path


def write_pile(path: Path, docs: list[str], sets: list[str] | None = None, frames: int = 3) -> Path:
    """Pile .jsonl.zst: several zstd frames, no content size in their headers."""
    lines = [
        json.dumps({"text": d, "meta": {"pile_set_name": (sets[i % len(sets)] if sets else "Pile-CC")}}) + "\n"
        for i, d in enumerate(docs)
    ]
    per = -(-len(lines) // frames)
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=False)
    path.write_bytes(b"".join(compressor.compress("".join(lines[i : i + per]).encode()) for i in range(0, len(lines), per)))
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_txt_dir(path: Path, docs: list[str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (path / f"doc{i:04d}.txt").write_text(d)
    return path


def test_owt_tar_is_nested_xz_tars(tmp_path):
    path = write_owt_tar(tmp_path / "openwebtext.tar.xz", documents(10))
    with tarfile.open(path, "r:xz") as outer:
        names = outer.getnames()
        assert names == ["openwebtext/urlsf_subset00-1_data.xz", "openwebtext/urlsf_subset01-1_data.xz"]
        inner = outer.extractfile(names[0]).read()
    assert inner[:6] == b"\xfd7zXZ\x00"  # an xz stream
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(inner))) as tar:
        assert all(n.endswith(".txt") for n in tar.getnames())


def test_pile_frames_have_no_content_size(tmp_path):
    path = write_pile(tmp_path / "00.jsonl.zst", documents(30), frames=3)
    data = path.read_bytes()
    # the one-shot API needs a content size in the frame header: exactly what the Pile lacks
    with pytest.raises(zstandard.ZstdError, match="content size"):
        zstandard.ZstdDecompressor().decompress(data)
    assert zstandard.frame_content_size(data) == -1
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    assert reader.read().count(b"\n") == 30
