"""`prepare-data --part I/N` + `--merge`: the merged dataset is byte-identical to the single-process
run, in every real input format, and a killed part is rerun alone. The SLURM test submits the parts
as an array with the merge after them on the local cluster."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nlq_scale.cli import main
from tests.conftest import nlq
from tests.test_cluster_slurm import local_slurm, slurm_cluster  # noqa: F401  (the cluster fixtures)
from tests.test_data_helpers import documents, write_jsonl, write_pile
from tests.test_data_prepare import DOCS, FORMATS, SEQ, run, tree

SMALL_SHARDS = ("--shard-size", "0.004")  # ~4 KiB: several shards per split, so shard cuts are compared too


def parts(out, count, *args):
    for i in range(1, count + 1):
        assert run(*args, "--out", out, "--part", f"{i}/{count}")[0] == 0


def merge(out, *extra, capsys=None):
    code = main(["prepare-data", "--no-progress", "--merge", str(out), *extra])
    return code, (capsys.readouterr() if capsys else None)


def part_records(out):
    return [json.loads((p / "part.json").read_text()) for p in sorted(out.parent.glob(f"{out.name}.parts/part-*"))]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_merged_parts_are_byte_identical_to_one_process(fmt, tmp_path):
    source, writer = FORMATS[fmt]
    src = writer(tmp_path)
    args = ("--source", source, "--input", src, "--val-fraction", "0.1", *SMALL_SHARDS)
    assert run(*args, "--out", tmp_path / "one")[0] == 0
    parts(tmp_path / "par", 3, *args)
    records = part_records(tmp_path / "par")
    assert sum(r["documents"] for r in records) == len(DOCS)
    if fmt in ("openwebtext-parquet", "text"):  # rows / files: these small inputs split across parts
        assert sum(1 for r in records if r["documents"]) >= 2
    assert merge(tmp_path / "par", "--workers", "3")[0] == 0  # shard ranges written by 3 processes
    one = tree(tmp_path / "one")
    assert len([k for k in one if k.endswith(".mds")]) > 2
    assert tree(tmp_path / "par") == one  # every shard, both index.json and the manifest
    assert not (tmp_path / "par.parts").exists()


def test_one_big_file_splits_inside_and_skips_val_docs_merge(tmp_path):
    """One plain jsonl bigger than several read blocks is cut inside; bad lines, a truncated zst and
    --val-docs (the N smallest hashes over all parts) come out as in one process."""
    docs = documents()
    big = tmp_path / "in" / "a.jsonl"
    big.parent.mkdir()
    lines = [json.dumps({"text": d}) for d in docs * 3]
    lines[5], lines[len(lines) // 2] = "not json", json.dumps({"text": ""})
    big.write_text("\n".join(lines) + "\n")
    trunc = write_pile(tmp_path / "in" / "b.jsonl.zst", DOCS)
    trunc.write_bytes(trunc.read_bytes()[:-30])
    args = ("--source", "jsonl", "--input", tmp_path / "in", "--val-docs", "7", "--skip-bad", *SMALL_SHARDS)
    assert big.stat().st_size > 4 * (1 << 18)
    assert run(*args, "--out", tmp_path / "one")[0] == 0
    parts(tmp_path / "par", 4, *args)
    records = part_records(tmp_path / "par")
    assert [bool(r["documents"]) for r in records] == [True, True, True, True]  # the big file is cut 3 ways
    assert merge(tmp_path / "par")[0] == 0
    assert tree(tmp_path / "par") == tree(tmp_path / "one")
    m = json.loads((tmp_path / "par" / "manifest.json").read_text())
    assert m["skipped"]["by_kind"] == {"empty": 1, "invalid_json": 1, "truncated": 1}
    assert m["splits"]["val"]["documents"] == 7
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == sum(r["tokens"] for r in records)


def test_killed_part_is_rerun_alone(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", documents() * 4)
    args = ("--source", "jsonl", "--input", src, "--val-fraction", "0.1")
    out = tmp_path / "ds"
    parts(out, 2, *args)
    first = out.parent / "ds.parts" / "part-00001-of-00002"
    second = out.parent / "ds.parts" / "part-00002-of-00002"
    before = (first / "tokens.u16").stat().st_ino
    proc = subprocess.Popen([sys.executable, "-m", "nlq_scale.cli", "prepare-data", "--no-progress", "--seq-len",
                             str(SEQ), *map(str, args), "--out", str(out), "--part", "2/2", "--workers", "1"])
    deadline = time.time() + 60
    while not list(second.parent.glob(".part-00002-of-00002.partial-*/tokens.u16")):  # mid-write
        assert proc.poll() is None and time.time() < deadline, "the part finished before it could be killed"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (second / "part.json").is_file()  # the earlier complete run of part 2 is untouched ...
    os.rename(second, tmp_path / "lost")  # ... so lose it, as if that had been the first attempt
    code, res = merge(out, capsys=capsys)
    assert code == 2 and "part 2/2 missing" in res.err and len(res.err.strip().splitlines()) == 1
    assert not out.exists()
    parts_args = [*args, "--out", out, "--part", "2/2"]
    assert run(*parts_args)[0] == 0  # the rerun clears the killed attempt's partial directory
    assert not list(second.parent.glob(".part-*")) and (first / "tokens.u16").stat().st_ino == before
    assert merge(out)[0] == 0
    assert run(*args, "--out", tmp_path / "one")[0] == 0
    assert tree(out) == tree(tmp_path / "one")


def test_local_executor_runs_parts_as_processes_then_merges(tmp_path, capsys):
    src = write_pile(tmp_path / "00.jsonl.zst", DOCS)
    args = ("--source", "pile", "--input", src, "--val-fraction", "0.1", *SMALL_SHARDS)
    assert run(*args, "--out", tmp_path / "one")[0] == 0
    assert run(*args, "--out", tmp_path / "par", "--parts", "3", "--executor", "local")[0] == 0
    assert tree(tmp_path / "par") == tree(tmp_path / "one")
    bad = write_jsonl(tmp_path / "bad.jsonl", ["fine", "also fine"])
    bad.write_text(bad.read_text() + "{not json\n")
    capsys.readouterr()
    code, res = run("--source", "jsonl", "--input", bad, "--out", tmp_path / "bad", "--parts", "2", "--executor", "local",
                    capsys=capsys)
    assert code == 2 and f"{bad}:3: invalid JSON" in res.err and len(res.err.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def test_parts_of_different_requests_are_refused(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    out = tmp_path / "ds"
    assert run("--source", "jsonl", "--input", src, "--out", out, "--part", "1/2")[0] == 0
    assert run("--source", "jsonl", "--input", src, "--out", out, "--part", "2/2", "--val-fraction", "0.2")[0] == 0
    code, res = merge(out, capsys=capsys)
    assert code == 2 and "part-00002-of-00002" in res.err and "recorded differ" in res.err
    assert run("--source", "jsonl", "--input", src, "--out", out, "--part", "1/3")[0] == 0
    code, res = merge(out, capsys=capsys)
    assert code == 2 and "[2, 3]" in res.err and "stale" in res.err
    code, res = run("--source", "jsonl", "--input", src, "--out", out, "--part", "3/2", capsys=capsys)
    assert code == 2 and "--part 3/2" in res.err
    code, res = merge(tmp_path / "nothing", capsys=capsys)
    assert code == 2 and "no parts" in res.err
    assert not out.exists()


def submit_on_slurm(src, out, *args) -> dict:
    submitted = nlq("prepare-data", "--source", "jsonl", "--input", str(src), "--out", str(out), *args,
                    "--parts", "2", "--executor", "slurm", "--cluster", "local-slurm", "--json")
    assert submitted.returncode == 0, submitted.stderr
    jobs = json.loads(submitted.stdout)
    assert jobs["parts"] == 2 and jobs["merge_job"] != jobs["parts_job"]
    return jobs


def wait_jobs_gone(jobs: dict, out, timeout: float = 120) -> dict[str, str]:
    """Until the parts and the merge left the queue (or the merged dataset is there); the logs."""
    ours = (f"{jobs['parts_job']}_", f"{jobs['merge_job']} ")
    deadline = time.time() + timeout
    while not (out / "manifest.json").exists() and time.time() < deadline:
        queue = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T %r"], capture_output=True, text=True).stdout
        if not [line for line in queue.splitlines() if line.startswith(ours)]:
            time.sleep(1)  # all ended: give a just-finished merge's rename a moment
            break
        time.sleep(1)
    return {p.name: p.read_text() for p in (out.parent / f"{out.name}.parts" / "_submitit").glob("*/*.err")}


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_array_of_parts_then_dependent_merge(slurm_cluster, tmp_path):  # noqa: F811
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    args = ["--val-fraction", "0.1", "--seq-len", str(SEQ), "--no-progress"]
    out = tmp_path / "ds"
    jobs = submit_on_slurm(src, out, *args)
    merge_script = next((tmp_path / "ds.parts" / "_submitit").glob(f"*/{jobs['merge_job']}_submission.sh")).read_text()
    assert f"--dependency=afterok:{jobs['parts_job']}" in merge_script
    logs = wait_jobs_gone(jobs, out)
    assert (out / "manifest.json").exists(), f"no merged dataset; logs: {logs}"
    assert nlq("prepare-data", "--source", "jsonl", "--input", str(src), *args, "--out", str(tmp_path / "one")).returncode == 0
    assert tree(out) == tree(tmp_path / "one")
    assert not list((tmp_path / "ds.parts").glob("part-*"))  # merged and removed; the logs stay


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_failed_part_cancels_the_merge(slurm_cluster, tmp_path):  # noqa: F811
    lines = [json.dumps({"text": d}) for d in DOCS]
    lines[-3] = "not json"
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "ds"
    jobs = submit_on_slurm(src, out, "--seq-len", str(SEQ))
    logs = wait_jobs_gone(jobs, out)
    assert not out.exists()
    failed = [text for name, text in logs.items() if name.startswith(f"{jobs['parts_job']}_1_")]
    assert failed and f"{src}:{len(lines) - 2}: invalid JSON" in failed[0]
    assert not [name for name in logs if name.startswith(f"{jobs['merge_job']}_")]  # the merge never ran
    assert (tmp_path / "ds.parts" / "part-00001-of-00002" / "part.json").is_file()
