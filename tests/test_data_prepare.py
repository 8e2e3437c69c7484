import hashlib
import json
import subprocess
import sys

import pytest

from nlq_scale.cli import main
from nlq_scale.data.prepare import doc_key
from nlq_scale.data.tokenizer import gpt2_tokenizer
from tests.test_data_helpers import documents, write_jsonl, write_owt_tar, write_parquet, write_pile, write_txt_dir

DOCS = documents(300)
SEQ = 64


def run(*args, capsys=None):
    code = main(["prepare-data", "--no-progress", "--seq-len", str(SEQ), *map(str, args)])
    return code, (capsys.readouterr() if capsys else None)


def tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def manifest(root):
    return json.loads((root / "manifest.json").read_text())


FORMATS = {
    "openwebtext-parquet": ("openwebtext", lambda d: write_parquet(d / "train-00000-of-00001.parquet", DOCS)),
    "openwebtext-tar": ("openwebtext", lambda d: write_owt_tar(d / "openwebtext.tar.xz", DOCS)),
    "pile": ("pile", lambda d: write_pile(d / "00.jsonl.zst", DOCS)),
    "text": ("text", lambda d: write_txt_dir(d / "txt", DOCS)),
    "jsonl": ("jsonl", lambda d: write_jsonl(d / "docs.jsonl", DOCS)),
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Every format prepared from the same documents."""
    out = {}
    for name, (source, writer) in FORMATS.items():
        base = tmp_path_factory.mktemp(name)
        src = writer(base)
        code, _ = run("--source", source, "--input", src, "--out", base / "ds", "--val-fraction", "0.1")
        assert code == 0
        out[name] = base / "ds"
    return out


def test_manifest_describes_inputs_tokens_and_shards(prepared, tmp_path):
    ds = prepared["pile"]
    m = manifest(ds)
    (inp,) = m["inputs"]
    assert inp["name"] == "00.jsonl.zst"
    assert inp["sha256"] == hashlib.sha256((ds.parent / "00.jsonl.zst").read_bytes()).hexdigest()
    assert m["tokenizer"]["n_vocab"] == 50257 and m["tokenizer"]["eot"] == 50256
    assert m["options"]["seq_len"] == SEQ
    tok = gpt2_tokenizer()
    expected_tokens = sum(len(t) for t in tok.encode_documents(DOCS))
    splits = m["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == len(DOCS)
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == expected_tokens
    for split in ("train", "val"):
        s = splits[split]
        assert s["sequences"] == s["tokens"] // (SEQ + 1)
        assert s["dropped_tail_tokens"] == s["tokens"] % (SEQ + 1)
        assert sum(sh["samples"] for sh in s["shards"]) == s["sequences"]
        for sh in s["shards"]:
            assert (ds / sh["raw_data"]["file"]).stat().st_size == sh["raw_data"]["bytes"]
    assert m["skipped"]["count"] == 0


def test_val_split_is_by_document_hash(prepared):
    """The hash is part of the data's contract (docs/data.md): another one would move documents
    between the splits of datasets prepared before and after."""
    keys = [int.from_bytes(hashlib.blake2b(d.encode("utf-8"), digest_size=8).digest(), "big") for d in DOCS]
    assert [doc_key(d) for d in DOCS] == keys
    val_docs = [d for d, key in zip(DOCS, keys, strict=True) if key < 0.1 * 2**64]
    assert 0 < len(val_docs) < len(DOCS)
    assert manifest(prepared["pile"])["splits"]["val"]["documents"] == len(val_docs)


def test_same_documents_same_shards_in_every_format(prepared):
    reference = {k: v for k, v in tree(prepared["pile"]).items() if k != "manifest.json"}
    for name, ds in prepared.items():
        assert {k: v for k, v in tree(ds).items() if k != "manifest.json"} == reference, name


def test_rerun_byte_identical_whatever_workers_or_input_order(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", DOCS[:150])
    b = write_jsonl(tmp_path / "b.jsonl", DOCS[150:])
    assert run("--source", "jsonl", "--input", b, a, "--out", tmp_path / "one", "--workers", "1")[0] == 0
    assert run("--source", "jsonl", "--input", a, b, "--out", tmp_path / "two", "--workers", "3")[0] == 0
    assert tree(tmp_path / "one") == tree(tmp_path / "two")
    capsys.readouterr()
    before = tree(tmp_path / "one")
    code, out = run("--source", "jsonl", "--input", a, b, "--out", tmp_path / "one", "--json", capsys=capsys)
    assert code == 0 and json.loads(out.out)["outcome"] == "unchanged"
    assert tree(tmp_path / "one") == before


def test_val_docs_picks_n_smallest_hashes(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    assert run("--source", "jsonl", "--input", src, "--out", tmp_path / "ds", "--val-docs", "7")[0] == 0
    assert manifest(tmp_path / "ds")["splits"]["val"]["documents"] == 7
    assert manifest(tmp_path / "ds")["options"]["val"] == {"docs": 7}


def test_overwriting_a_different_dataset_needs_force(tmp_path, capsys):
    src1 = write_jsonl(tmp_path / "one.jsonl", DOCS[:200])
    src2 = write_jsonl(tmp_path / "two.jsonl", DOCS[100:])
    out = tmp_path / "ds"
    assert run("--source", "jsonl", "--input", src1, "--out", out)[0] == 0
    before = tree(out)
    capsys.readouterr()
    code, res = run("--source", "jsonl", "--input", src2, "--out", out, capsys=capsys)
    assert code == 2 and "--force" in res.err and str(out) in res.err
    assert tree(out) == before
    assert run("--source", "jsonl", "--input", src2, "--out", out, "--force")[0] == 0
    assert manifest(out)["inputs"][0]["name"] == "two.jsonl"
    assert not list(tmp_path.glob(".ds.*"))


def test_refuses_to_write_into_a_directory_that_is_not_a_dataset(tmp_path, capsys):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.tex").write_text("do not delete")
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    code, res = run("--source", "jsonl", "--input", src, "--out", out, "--force", capsys=capsys)
    assert code == 2 and "not a prepared dataset" in res.err
    assert (out / "thesis.tex").read_text() == "do not delete"


def test_bad_line_fails_naming_file_and_line_and_leaves_nothing(tmp_path, capsys):
    src = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": d}) for d in DOCS[:20]]
    lines[12] = '{"text": "unterminated'
    src.write_text("\n".join(lines) + "\n")
    code, res = run("--source", "jsonl", "--input", src, "--out", tmp_path / "ds", capsys=capsys)
    assert code == 2
    assert f"{src}:13: invalid JSON" in res.err and "--skip-bad" in res.err
    assert len(res.err.strip().splitlines()) == 1
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds.*"))


def test_skip_bad_counts_in_manifest(tmp_path):
    src = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": d}) for d in DOCS[:200]]
    lines[3] = "not json"
    lines[7] = json.dumps({"text": ""})
    src.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "\xff"}\n')
    trunc = write_pile(tmp_path / "t.jsonl.zst", DOCS[200:])
    trunc.write_bytes(trunc.read_bytes()[:-30])
    (tmp_path / "in").mkdir()
    src.rename(tmp_path / "in" / "d.jsonl")
    trunc.rename(tmp_path / "in" / "t.jsonl.zst")
    assert run("--source", "jsonl", "--input", tmp_path / "in", "--out", tmp_path / "ds", "--skip-bad")[0] == 0
    skipped = manifest(tmp_path / "ds")["skipped"]
    assert skipped["by_kind"] == {"empty": 1, "invalid_json": 1, "not_utf8": 1, "truncated": 1}
    assert skipped["count"] == 4
    assert {s["where"].rsplit("/", 1)[-1] for s in skipped["listed"]} >= {"d.jsonl:4", "d.jsonl:8", "d.jsonl:201"}


def test_truncated_input_fails_without_skip_bad(tmp_path, capsys):
    src = write_pile(tmp_path / "00.jsonl.zst", DOCS)
    src.write_bytes(src.read_bytes()[:-30])
    code, res = run("--source", "pile", "--input", src, "--out", tmp_path / "ds", capsys=capsys)
    assert code == 2 and str(src) in res.err and "truncated" in res.err


def test_pile_sets_filter_is_counted(tmp_path):
    src = write_pile(tmp_path / "00.jsonl.zst", DOCS, sets=["Pile-CC", "Github"])
    assert run("--source", "pile", "--input", src, "--out", tmp_path / "ds", "--pile-sets", "Pile-CC")[0] == 0
    m = manifest(tmp_path / "ds")
    assert m["filtered"] == {"count": 150, "by_pile_set": {"Github": 150}}
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 150


def test_usage_errors_are_one_line(tmp_path, capsys):
    code, res = run("--source", "pile", "--input", tmp_path / "nope.jsonl.zst", "--out", tmp_path / "ds", capsys=capsys)
    assert code == 2 and "no such file" in res.err
    src = write_jsonl(tmp_path / "d.jsonl", DOCS[:3])
    code, res = run("--source", "jsonl", "--input", src, "--out", tmp_path / "ds", "--val-fraction", "1.5", capsys=capsys)
    assert code == 2 and "--val-fraction" in res.err
    tiny = write_jsonl(tmp_path / "tiny.jsonl", ["a few words", "and a few more"])
    code, res = run("--source", "jsonl", "--input", tiny, "--out", tmp_path / "ds", capsys=capsys)
    assert code == 2 and "no training sequence" in res.err
    assert not (tmp_path / "ds").exists()


def test_help_does_not_import_streaming():
    code = "import sys; from nlq_scale.cli import build_parser; build_parser(); print('streaming' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_sample_corpus_is_deterministic_and_prepares(tmp_path):
    from nlq_scale.data.sample import sample_corpus

    files = sample_corpus(tmp_path / "corpus")
    assert [f.name for f in files] == ["00-pydoc-topics.jsonl.zst", "01-python-stdlib.jsonl.zst",
                                       "02-numpy.jsonl.zst", "03-matplotlib.jsonl.zst"]
    out = subprocess.run([sys.executable, "-m", "nlq_scale.cli", "prepare-data", "--sample", "--out",
                          str(tmp_path / "ds"), "--seq-len", "256", "--no-progress", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    m = manifest(tmp_path / "ds")
    # the CLI wrote the corpus again, elsewhere: the very same bytes
    assert [(i["name"], i["sha256"]) for i in m["inputs"]] == [
        (f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in files
    ]
    tokens = summary["splits"]["train"]["tokens"] + summary["splits"]["val"]["tokens"]
    assert tokens > 1_000_000 and m["options"]["val"] == {"fraction": 0.1}
    assert not list(tmp_path.glob(".ds.*"))


def test_partial_dirs_of_dead_runs_are_removed(tmp_path):
    import os
    import socket

    host = socket.gethostname().split(".")[0]
    dead = tmp_path / f".ds.partial-{host}-{2**22 + 12345}"  # above pid_max: never a live process
    live = tmp_path / f".ds.partial-{host}-{os.getppid()}"
    for d in (dead, live):
        d.mkdir()
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    assert run("--source", "jsonl", "--input", src, "--out", tmp_path / "ds")[0] == 0
    assert not dead.exists() and live.exists()


def test_window_bytes_are_what_streamings_encoder_writes(tmp_path):
    """The writer hands MDS each window as bytes: the shards must equal those of streaming's own
    ndarray encoder, byte for byte."""
    import numpy as np

    from nlq_scale.data.prepare import PrepareOptions, mds_writer, window_writer

    opts = PrepareOptions(source="text", inputs=[tmp_path], out=tmp_path / "unused", seq_len=16, shard_bytes=256)
    windows = np.random.default_rng(0).integers(0, 50257, size=(40, opts.window), dtype=np.uint16)
    encoded, ours = mds_writer(opts, tmp_path / "encoded"), mds_writer(opts, tmp_path / "ours")
    write = window_writer(ours)
    for w in windows:
        encoded.write({"tokens": w})
        write(w)
    encoded.finish()
    ours.finish()
    files = sorted(p.name for p in (tmp_path / "encoded").iterdir())
    assert len(files) > 3 and files == sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert all((tmp_path / "encoded" / f).read_bytes() == (tmp_path / "ours" / f).read_bytes() for f in files)
