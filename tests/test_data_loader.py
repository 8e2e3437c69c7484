import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from nlq_scale.cli import main
from nlq_scale.config.schema import DataConfig, StreamConfig
from nlq_scale.data.loader import (
    batch_digest,
    dataset_manifest_sha256,
    make_train_loader,
    make_val_set,
    sequence_digests,
)
from nlq_scale.data.prepared import CorruptShard
from nlq_scale.errors import UsageError
from nlq_scale.runtime.launch import hosted_store, rank_env
from tests.test_data_helpers import documents, write_jsonl

SEQ = 32
REPO = Path(__file__).resolve().parents[1]


def prepare(root: Path, docs: list[str], *extra: str) -> Path:
    src = write_jsonl(root / "src.jsonl", docs)
    out = root / "ds"
    assert main(["prepare-data", "--no-progress", "--source", "jsonl", "--input", str(src), "--out", str(out),
                 "--seq-len", str(SEQ), "--val-fraction", "0.1", "--shard-size", "0.01", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("a"), documents()[:300])


@pytest.fixture(scope="module")
def other_dataset(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("b"), documents()[300:700])


def loader(data, tmp, batch, rank=0, size=1):
    return make_train_loader(data, seq_length=SEQ, rank_batch_size=batch, dp_rank=rank, dp_size=size,
                             tmp_dir=tmp)


def global_digest(rank_batches):
    """What batch_digest computes across ranks, for loaders living in one process."""
    rows = sorted(bytes(r) for b in rank_batches for r in sequence_digests(b))
    return hashlib.blake2b(b"".join(rows), digest_size=16).hexdigest()


def digests(train_loader, steps):
    return [batch_digest(b) for b in itertools.islice(train_loader, steps)]


def test_batches_shape_dtype_and_epochs(dataset, tmp_path):
    data = DataConfig(path=str(dataset))
    one = loader(data, tmp_path, 16)
    try:
        steps = one.steps_per_epoch
        assert steps == one._dataset.epoch_size // 16 and steps > 10
        batches = list(itertools.islice(one, 2 * steps))
        assert all(b.shape == (16, SEQ + 1) and b.dtype == torch.int64 for b in batches)
        epochs = [[bytes(r) for r in sequence_digests(torch.cat(batches[i * steps : (i + 1) * steps]))] for i in (0, 1)]
        # an epoch never repeats a sequence; the next epoch is another order of the same ones (less the cut)
        assert len(set(epochs[0])) == steps * 16
        assert epochs[0] != epochs[1] and len(set(epochs[0]) & set(epochs[1])) > 0.9 * steps * 16
        assert one.state_dict()["epoch"] == 2 and one.state_dict()["step_in_epoch"] == 0
        first_epoch = torch.cat(batches[:steps])
        assert int(first_epoch.max()) <= 50256
    finally:
        one.close()


def test_global_batch_same_for_one_or_two_ranks(dataset, tmp_path):
    data = DataConfig(path=str(dataset), seed=7)
    one = loader(data, tmp_path, 16)
    a, b = loader(data, tmp_path, 8, 0, 2), loader(data, tmp_path, 8, 1, 2)
    try:
        steps = one.steps_per_epoch + 5  # across an epoch boundary
        assert digests(one, steps) == [global_digest(p) for p in itertools.islice(zip(a, b), steps)]
    finally:
        for x in (one, a, b):
            x.close()


def test_seed_changes_the_stream(dataset, tmp_path):
    x = loader(DataConfig(path=str(dataset), seed=1), tmp_path, 16)
    y = loader(DataConfig(path=str(dataset), seed=2), tmp_path, 16)
    try:
        assert digests(x, 3) != digests(y, 3)
    finally:
        x.close()
        y.close()


def test_exact_resume_mid_epoch_and_from_two_ranks_to_one(dataset, tmp_path):
    data = DataConfig(path=str(dataset), seed=3)
    ref = loader(data, tmp_path, 16)
    reference = digests(ref, 2 * ref.steps_per_epoch + 4)
    ref.close()

    first = loader(data, tmp_path, 16)
    digests(first, 9)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    first.close()
    resumed = loader(data, tmp_path, 16)
    resumed.load_state_dict(state)
    assert digests(resumed, 20) == reference[9:29]
    resumed.close()

    a, b = loader(data, tmp_path, 8, 0, 2), loader(data, tmp_path, 8, 1, 2)
    k = ref.steps_per_epoch + 2
    list(itertools.islice(zip(a, b), k))
    state = a.state_dict()
    assert state == b.state_dict()
    a.close()
    b.close()
    single = loader(data, tmp_path, 16)
    single.load_state_dict(state)
    assert digests(single, 10) == reference[k : k + 10]
    # rewinding the same loader works too
    single.load_state_dict({**state, "epoch": 0, "step_in_epoch": 0})
    assert digests(single, 3) == reference[:3]
    single.close()


def test_resume_state_must_match_the_stream(dataset, tmp_path):
    one = loader(DataConfig(path=str(dataset), seed=3), tmp_path, 16)
    try:
        state = one.state_dict()
        with pytest.raises(UsageError, match="seed"):
            one.load_state_dict({**state, "seed": 4})
        with pytest.raises(UsageError, match="global_batch"):
            one.load_state_dict({**state, "global_batch": 32})
        with pytest.raises(UsageError, match="out of range"):
            one.load_state_dict({**state, "step_in_epoch": one.steps_per_epoch})
    finally:
        one.close()


def test_mixture_proportions(dataset, other_dataset, tmp_path):
    def sequences_of(path):
        one = loader(DataConfig(path=str(path)), tmp_path, 1)
        rows = {bytes(r) for b in itertools.islice(one, one.steps_per_epoch) for r in sequence_digests(b)}
        one.close()
        return rows

    a_rows, b_rows = sequences_of(dataset), sequences_of(other_dataset)
    mix = DataConfig(streams=[StreamConfig(path=str(dataset), proportion=0.7),
                              StreamConfig(path=str(other_dataset), proportion=0.3)], seed=5)
    m = loader(mix, tmp_path, 16)
    epoch = [bytes(r) for b in itertools.islice(m, m.steps_per_epoch) for r in sequence_digests(b)]
    m.close()
    from_a = sum(r in a_rows for r in epoch)
    from_b = sum(r in b_rows for r in epoch)
    assert from_a + from_b == len(epoch)
    assert abs(from_a / len(epoch) - 0.7) < 0.02
    again = loader(mix, tmp_path, 16)
    assert [bytes(r) for b in itertools.islice(again, 5) for r in sequence_digests(b)] == epoch[: 5 * 16]
    again.close()
    entries = sorted([[dataset_manifest_sha256(DataConfig(path=str(p))), w]
                      for p, w in ((dataset, 0.7), (other_dataset, 0.3))])
    assert dataset_manifest_sha256(mix) == hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def test_val_set_is_fixed(dataset, other_dataset, tmp_path):
    data = DataConfig(path=str(dataset), val_sequences=20)
    first = make_val_set(data, seq_length=SEQ)
    assert first.shape == (20, SEQ + 1) and first.dtype == torch.int64
    train = loader(DataConfig(path=str(dataset), val_sequences=20, seed=9), tmp_path, 16)
    list(itertools.islice(train, 5))
    train.close()
    assert torch.equal(make_val_set(DataConfig(path=str(dataset), val_sequences=20, seed=9), seq_length=SEQ), first)
    train_rows = {bytes(r) for r in sequence_digests(torch.cat(list(itertools.islice(
        loader(DataConfig(path=str(dataset)), tmp_path / "t2", 16), 30))))}
    assert not train_rows & {bytes(r) for r in sequence_digests(first)}
    mix = DataConfig(streams=[StreamConfig(path=str(dataset), proportion=3),
                              StreamConfig(path=str(other_dataset), proportion=1)], val_sequences=20)
    mixed = make_val_set(mix, seq_length=SEQ)
    assert torch.equal(mixed[:15], make_val_set(DataConfig(path=str(dataset), val_sequences=15), seq_length=SEQ))
    with pytest.raises(UsageError, match="val_sequences"):
        make_val_set(DataConfig(path=str(dataset), val_sequences=100_000), seq_length=SEQ)


def test_named_val_sets_are_fixed_and_sized_like_the_main_one(dataset, other_dataset):
    from nlq_scale.config.schema import ValidationSetConfig
    from nlq_scale.data.loader import make_val_sets

    named = [ValidationSetConfig(name="same", path=str(dataset), sequences=20),
             ValidationSetConfig(name="other", path=str(other_dataset), sequences=8)]
    sets = make_val_sets(DataConfig(path=str(dataset), val_sequences=20, validation=named), seq_length=SEQ)
    assert list(sets) == ["val/loss", "val/same/loss", "val/other/loss"]
    assert torch.equal(sets["val/same/loss"], sets["val/loss"])
    assert torch.equal(sets["val/other/loss"], make_val_set(DataConfig(path=str(other_dataset), val_sequences=8), seq_length=SEQ))
    too_many = [ValidationSetConfig(name="x", path=str(other_dataset), sequences=100_000)]
    with pytest.raises(UsageError, match=r"data.validation\[0\].sequences: .* holds \d+ sequences"):
        make_val_sets(DataConfig(path=str(dataset), val_sequences=20, validation=too_many), seq_length=SEQ)


def test_bad_dataset_paths_and_shapes(dataset, tmp_path):
    with pytest.raises(UsageError, match="no such dataset directory"):
        loader(DataConfig(path=str(tmp_path / "missing")), tmp_path, 16)
    (tmp_path / "raw").mkdir()
    with pytest.raises(UsageError, match=r"data.streams\[0\].path .*not a prepared dataset"):
        loader(DataConfig(streams=[StreamConfig(path=str(tmp_path / "raw"), proportion=1)]), tmp_path, 16)
    with pytest.raises(UsageError, match="--seq-len 64"):
        make_train_loader(DataConfig(path=str(dataset)), seq_length=64, rank_batch_size=1, dp_rank=0, dp_size=1,
                          tmp_dir=tmp_path)
    with pytest.raises(UsageError, match="fewer than one global batch"):
        loader(DataConfig(path=str(dataset)), tmp_path, 100_000)
    with pytest.raises(UsageError, match="num_canonical_nodes"):
        loader(DataConfig(path=str(dataset), num_canonical_nodes=2), tmp_path, 4, 0, 3)
    assert not (tmp_path / "streaming").exists()


def test_missing_and_corrupted_shards_are_named(dataset, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    shard = sorted((copy / "train").glob("shard.*.mds"))[0]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    one = loader(DataConfig(path=str(copy)), tmp_path, 16)
    with pytest.raises(CorruptShard, match=f"{shard}: corrupted shard"):
        list(itertools.islice(one, one.steps_per_epoch))
    one.close()
    shard.unlink()
    with pytest.raises(UsageError, match=f"{shard}: shard missing"):
        loader(DataConfig(path=str(copy)), tmp_path, 16)


def test_zstd_shards_are_decompressed_beside_and_read(tmp_path, dataset):
    compressed = prepare(tmp_path, documents()[:300], "--compression", "zstd")
    assert not list((compressed / "train").glob("*.mds"))
    a = loader(DataConfig(path=str(compressed)), tmp_path, 1)
    b = loader(DataConfig(path=str(dataset)), tmp_path, 1)
    # same sequences (the shard layout, and so the shuffle, may differ)
    sequences = json.loads((dataset / "manifest.json").read_text())["splits"]["train"]["sequences"]
    assert a.steps_per_epoch == b.steps_per_epoch == sequences
    epoch = [sorted(bytes(r) for x in itertools.islice(ld, ld.steps_per_epoch) for r in sequence_digests(x)) for ld in (a, b)]
    assert epoch[0] == epoch[1]
    a.close()
    b.close()
    assert list((compressed / "train").glob("*.mds")) and list((compressed / "train").glob("*.mds.zstd"))


def segments(prefix):
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix:06}_*"))


def test_close_releases_only_its_own_shared_memory(dataset, tmp_path):
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    py_rng, np_rng = random.getstate(), np.random.get_state()
    keep = loader(DataConfig(path=str(dataset)), tmp_path, 16)
    gone = loader(DataConfig(path=str(dataset)), tmp_path, 16)
    assert {k: os.environ.get(k) for k in env} == env
    assert random.getstate() == py_rng and np.array_equal(np.random.get_state()[1], np_rng[1])
    list(itertools.islice(gone, gone.steps_per_epoch + 1))  # crosses an epoch: a second resume segment
    mine, theirs = gone._ownership.prefix, keep._ownership.prefix
    assert mine != theirs and segments(mine) and segments(theirs)
    private = gone._ownership.private
    gone.close()
    gone.close()
    assert segments(mine) == [] and not private.exists()
    assert segments(theirs) and digests(keep, 2) and keep._ownership.private.exists()
    keep.close()
    assert segments(theirs) == []
    assert not (tmp_path / "streaming").exists()  # the last loader out removes the shared root


CHILD = textwrap.dedent("""
    import itertools, json, os, sys
    from pathlib import Path
    from nlq_scale.config.schema import DataConfig
    from nlq_scale.data.loader import make_train_loader
    loader = make_train_loader(DataConfig(path=sys.argv[1]), seq_length=32, rank_batch_size=16, dp_rank=0,
                               dp_size=1, tmp_dir=Path(sys.argv[2]))
    list(itertools.islice(loader, 3))
    print(json.dumps({"prefix": loader._ownership.prefix, "private": str(loader._ownership.private)}), flush=True)
    os.killpg(0, 9)  # the whole job, as SLURM does: python's resource tracker dies too
""")


@pytest.mark.slow
def test_sigkilled_loader_leftovers_are_reclaimed(dataset, tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(dataset), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dead = json.loads(proc.stdout.splitlines()[-1])
    owner = json.loads((Path(dead["private"]) / "owner.json").read_text())
    leaked = segments(dead["prefix"])
    assert f"{dead['prefix']:06}_resume" in leaked and f"{dead['prefix']:06}_locals" in leaked
    fresh = loader(DataConfig(path=str(dataset)), tmp_path, 16)
    try:
        assert not Path(dead["private"]).exists()
        locals_segment = Path("/dev/shm") / f"{dead['prefix']:06}_locals"
        assert not locals_segment.exists() or locals_segment.stat().st_ino != owner["locals_inode"]
        assert not (Path("/dev/shm") / f"{dead['prefix']:06}_resume").exists()
    finally:
        fresh.close()


@pytest.mark.slow
def test_same_stream_with_zero_or_two_workers(dataset, tmp_path):
    data0 = DataConfig(path=str(dataset), seed=11, num_workers=0)
    data2 = DataConfig(path=str(dataset), seed=11, num_workers=2)
    zero = loader(data0, tmp_path, 16)
    steps = zero.steps_per_epoch + 4
    reference = digests(zero, steps)
    zero.close()
    two = loader(data2, tmp_path, 16)
    assert digests(two, steps) == reference
    two.load_state_dict({**two.state_dict(), "epoch": 0, "step_in_epoch": 7})
    assert digests(two, 5) == reference[7:12]
    two.close()


@pytest.mark.slow
def test_corrupted_shard_named_from_a_worker(dataset, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    shard = sorted((copy / "train").glob("shard.*.mds"))[1]
    shard.write_bytes(shard.read_bytes()[:-4] + b"\0\0\0\0")
    one = loader(DataConfig(path=str(copy), num_workers=2), tmp_path, 16)
    with pytest.raises(CorruptShard) as err:
        list(itertools.islice(one, one.steps_per_epoch))
    one.close()
    assert str(err.value).startswith(f"{shard}: corrupted shard") and "\n" not in str(err.value)


RANK = textwrap.dedent("""
    import itertools, json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from nlq_scale.config.schema import DataConfig, ParallelConfig
    from nlq_scale.data.loader import batch_digest, make_train_loader
    from nlq_scale.runtime.dist import detect_env, init_distributed
    path, tmp, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    init_distributed(detect_env(), ParallelConfig(), device="cpu", timeout_min=1)
    rank = dist.get_rank()
    def build():
        return make_train_loader(DataConfig(path=path, seed=3), seq_length=32, rank_batch_size=8, dp_rank=rank,
                                 dp_size=2, tmp_dir=tmp)
    loader = build()
    out = [batch_digest(b) for b in itertools.islice(loader, steps)]
    state = loader.state_dict()
    loader.close()
    # only rank 0 builds a loader now (as under tensor parallelism): it must not wait for rank 1
    marker = torch.zeros(1)
    if rank == 0:
        build().close()
        marker += 42
    dist.broadcast(marker, src=0)
    if rank == 0:
        print(json.dumps({"digests": out, "state": state, "marker": float(marker)}), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_processes_match_one_and_resume_on_one(dataset, tmp_path):
    data = DataConfig(path=str(dataset), seed=3)
    ref = loader(data, tmp_path, 16)
    steps = ref.steps_per_epoch + 3
    reference = digests(ref, steps + 10)
    ref.close()
    with hosted_store() as port:
        procs = [
            subprocess.Popen([sys.executable, "-c", RANK, str(dataset), str(tmp_path / "job"), str(steps)],
                             env=rank_env(r, 2, port), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(2)
        ]
        outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    result = json.loads(outputs[0][0].splitlines()[-1])
    assert result["marker"] == 42.0
    assert result["digests"] == reference[:steps]
    single = loader(data, tmp_path, 16)
    single.load_state_dict(result["state"])
    assert digests(single, 10) == reference[steps:]
    single.close()
