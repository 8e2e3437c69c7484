import hashlib
import io
import json

import pytest
import zstandard
from tests.test_data_helpers import documents, write_jsonl, write_owt_tar, write_parquet, write_pile, write_txt_dir

from nlq_scale.data.sources import Bad, Document, Filtered, InputFile, SourceSpec, expand_inputs
from nlq_scale.errors import UsageError

DOCS = documents(40)


def read(path, spec):
    f = InputFile(path, spec)
    records = list(f)
    return records, f.digest


def texts(records):
    return [r.text for r in records if isinstance(r, Document)]


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "writer,name,spec",
    [
        (write_parquet, "train-00000-of-00080.parquet", SourceSpec("openwebtext")),
        (write_owt_tar, "openwebtext.tar.xz", SourceSpec("openwebtext")),
        (write_pile, "00.jsonl.zst", SourceSpec("pile")),
        (write_jsonl, "docs.jsonl", SourceSpec("jsonl")),
    ],
)
def test_each_format_streams_documents_in_order_and_hashes_the_file(tmp_path, writer, name, spec):
    path = writer(tmp_path / name, DOCS)
    records, digest = read(path, spec)
    assert texts(records) == DOCS
    assert digest.sha256 == sha(path) and digest.bytes == path.stat().st_size


def test_txt_is_one_document_per_file(tmp_path):
    folder = write_txt_dir(tmp_path / "txt", DOCS[:5])
    paths = expand_inputs("text", [folder])
    assert [texts(read(p, SourceSpec("text"))[0]) for p in paths] == [[d] for d in DOCS[:5]]


def test_inner_owt_archive_can_be_an_input(tmp_path):
    import tarfile

    outer = write_owt_tar(tmp_path / "openwebtext.tar.xz", DOCS, inner_archives=2)
    with tarfile.open(outer, "r:xz") as tar:
        tar.extractall(tmp_path / "x", filter="data")
    inner = expand_inputs("openwebtext", [tmp_path / "x"])
    assert [p.name for p in inner] == ["urlsf_subset00-1_data.xz", "urlsf_subset01-1_data.xz"]
    assert sum((texts(read(p, SourceSpec("openwebtext"))[0]) for p in inner), []) == DOCS


def test_jsonl_text_field_is_configurable_and_dotted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"body": {"content": "nested text"}}) + "\n")
    assert texts(read(path, SourceSpec("jsonl", text_field="body.content"))[0]) == ["nested text"]
    bad = read(path, SourceSpec("jsonl", text_field="text"))[0]
    assert bad == [Bad(f"{path}:1", "missing_field", "text field 'text' is missing")]


def test_pile_set_filter(tmp_path):
    path = write_pile(tmp_path / "00.jsonl.zst", DOCS[:6], sets=["Pile-CC", "Github", "ArXiv"])
    records, _ = read(path, SourceSpec("pile", pile_sets=frozenset({"ArXiv"})))
    assert texts(records) == [DOCS[2], DOCS[5]]
    assert sorted(r.group for r in records if isinstance(r, Filtered)) == ["Github", "Github", "Pile-CC", "Pile-CC"]


def test_bad_json_lines_name_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "broken\n\xff\xfe{"text": 1}\n{"text": "   "}\n[1]\n')
    bad = [r for r in read(path, SourceSpec("jsonl"))[0] if isinstance(r, Bad)]
    assert [(r.where, r.kind) for r in bad] == [
        (f"{path}:2", "invalid_json"),
        (f"{path}:3", "not_utf8"),
        (f"{path}:4", "empty"),
        (f"{path}:5", "invalid_json"),
    ]


@pytest.mark.parametrize("cut", [40, 1000, 3000])
def test_truncated_zst_is_reported_not_silently_short(tmp_path, cut):
    path = write_pile(tmp_path / "00.jsonl.zst", DOCS, frames=4)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - cut])
    records, digest = read(path, SourceSpec("pile"))
    assert isinstance(records[-1], Bad) and records[-1].kind == "truncated"
    assert str(path) in records[-1].where
    assert 0 < len(texts(records)) < len(DOCS)
    assert digest.sha256 == sha(path)  # the rest of the file is still hashed


def test_corrupt_zst(tmp_path):
    path = tmp_path / "00.jsonl.zst"
    path.write_bytes(b"not zstd at all" * 10)
    (record,) = read(path, SourceSpec("pile"))[0]
    assert record.kind == "corrupt"


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.9, 0.999])
def test_truncated_xz(tmp_path, keep):
    path = write_owt_tar(tmp_path / "openwebtext.tar.xz", DOCS)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    records, _ = read(path, SourceSpec("openwebtext"))
    assert any(isinstance(r, Bad) and r.kind == "truncated" and str(path) in r.where for r in records)


def test_non_utf8_txt(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"caf\xe9")
    assert read(path, SourceSpec("text"))[0] == [Bad(str(path), "not_utf8", "not valid UTF-8 (byte 3)")]


def test_parquet_without_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"content": ["a"]}), path)
    with pytest.raises(UsageError, match="no 'text' column"):
        read(path, SourceSpec("openwebtext"))


def test_expand_inputs_sorted_and_checked(tmp_path):
    b = write_jsonl(tmp_path / "b.jsonl", DOCS[:1])
    a = write_jsonl(tmp_path / "a.jsonl", DOCS[:1])
    assert expand_inputs("jsonl", [b, a, tmp_path]) == [a.resolve(), b.resolve()]
    with pytest.raises(UsageError, match="no such file"):
        expand_inputs("jsonl", [tmp_path / "missing.jsonl"])
    with pytest.raises(UsageError, match="not a --source pile file"):
        expand_inputs("pile", [write_txt_dir(tmp_path / "t", ["x"]) / "doc0000.txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no .txt files"):
        expand_inputs("text", [tmp_path / "empty"])


def test_zstd_long_window_frames(tmp_path):
    """The Pile's frames need a 2 GiB window: more than zstd's default decoder allows."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=31, enable_ldm=True, write_content_size=False)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    data = stream.compress((json.dumps({"text": "long window"}) + "\n").encode()) + stream.flush()
    with pytest.raises(zstandard.ZstdError, match="too much memory"):
        zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
    path = tmp_path / "ldm.jsonl.zst"
    path.write_bytes(data)
    assert texts(read(path, SourceSpec("pile"))[0]) == ["long window"]
