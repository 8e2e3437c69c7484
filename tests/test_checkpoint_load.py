"""The megatron engine saves the optimizer state from its own tensors and loads it into them,
writes in its own process and reads stored tensors straight into their targets (compat.megatron_save, compat.megatron_load):
it must write the very checkpoint megatron's own save writes, in the background too, without
forking; restore the very bits megatron's own load restores (at the layout the checkpoint was
saved at and at others); and read less through torch."""

import io
import json
import sys
import threading
import zipfile
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import run_ranks


def run(tmp_path, modes: str, nproc: int, *overrides: str) -> dict:
    """{mode: rank 0's result} of megatron_load.py's `modes` (save, compare or save,compare)."""
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    out = tmp_path / f"{modes}-{nproc}.json"
    run_ranks("megatron_load.py", nproc, modes, str(out), "--dir", str(tmp_path / "ckpt"), *overrides)
    return json.loads(out.read_text())


def assert_same_bits(result: dict) -> None:
    for rank in result["ranks"]:
        assert rank["keys"] > 0 and rank["differ"] == [], rank
        assert rank["torch_reads"]["in_place"] < rank["torch_reads"]["megatron"], rank


def parallel_split(overrides: list[str]) -> list[str]:
    return [o for o in overrides if o.startswith("parallel.")]


MOE_EP2 = ["model.moe.num_experts=4", "parallel.ep=2"]
# Saved at, then loaded at: the same layout with each parameter split across DP ranks or whole on
# one (DP resharding); TP resharding (partial reads: torch's reader); bf16 (fp32 main params of
# their own); MoE at EP=2 (a second optimizer, over the experts' own DP group).
LAYOUTS = {
    "dp2": ((2, []), ((2, []), (1, []))),
    "tp2-to-dp2": ((2, ["parallel.tp=2"]), ((2, []),)),
    "dp2-bf16": ((2, ["model.bf16=true"]), ((2, ["model.bf16=true"]),)),
    "moe-ep2": ((2, MOE_EP2), ((2, MOE_EP2),)),
}


@pytest.mark.slow
@pytest.mark.parametrize("layouts", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_in_place_save_and_load_match_megatrons(tmp_path, layouts):
    (save_n, save_at), loads = layouts
    at_once = loads[0] == (save_n, save_at)  # the first load is in the saved layout: the same ranks do it
    first = run(tmp_path, "save,compare" if at_once else "save", save_n, *save_at)
    saved = first["save"]
    assert any(".optimizer.state.exp_avg." in f".{k}" for k in saved["keys"]), saved["keys"]
    for way in ("ours", "background"):
        assert saved[way] == {"not_in_both": [], "differ": []}, (way, saved)
    # Written and reported in this process (no process started), where megatron's own writer spawns
    # a multiprocessing Manager for its results.
    assert saved["processes"]["ours"] == saved["processes"]["background"] == 0 < saved["processes"]["megatron"], saved

    for i, (load_n, load_at) in enumerate(loads):
        loaded = first["compare"] if at_once and i == 0 else run(tmp_path, "compare", load_n, *load_at)["compare"]
        assert_same_bits(loaded)
        # Only another TP/PP/EP split reshards the stored chunks (the optimizer state is stored
        # per parameter, whatever the DP split): any other load reads without planning.
        resharded = parallel_split(save_at) != parallel_split(load_at)
        assert all(rank["planned"] == {"megatron": 1, "in_place": int(resharded)} for rank in loaded["ranks"]), loaded
        assert any(rank["split"] for rank in loaded["ranks"]) == (load_n == 2)  # DP=2 splits some parameter


@pytest.mark.slow
def test_a_load_some_ranks_alone_would_read_as_saved_reshards_on_every_rank(tmp_path):
    """PP=3, loaded with the vocabulary padded otherwise (1000 -> 1024 rows): the middle stage holds
    no vocabulary tensor, so alone it would read as saved, but it joins the other stages' resharding
    load instead of leaving them waiting in its collectives, and every rank restores megatron's
    own load's bits. (The save is not compared with megatron's: at PP > 1 megatron-core 0.16.1's
    own save shifts the tied embedding's optimizer state, docs/training.md.)"""
    pp3 = ["parallel.pp=3", "model.num_layers=3"]
    run(tmp_path, "save", 3, *pp3)
    loaded = run(tmp_path, "compare", 3, *pp3, "model.make_vocab_size_divisible_by=64")["compare"]
    assert_same_bits(loaded)
    assert [rank["planned"] for rank in loaded["ranks"]] == [{"megatron": 1, "in_place": 1}] * 3


def saved(obj) -> bytes:
    item = io.BytesIO()
    torch.save(obj, item)
    return item.getvalue()


def rewritten(item: bytes, **changes) -> bytes:
    """The zip archive `item` rewritten record by record: `byteorder=` replaces that record's
    contents, `compression=` stores every record compressed."""
    copy = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(item)) as original, zipfile.ZipFile(copy, "w") as out:
        for info in original.infolist():
            data = changes["byteorder"] if "byteorder" in changes and info.filename.endswith("/byteorder") else original.read(info)
            out.writestr(info, data, compress_type=changes.get("compression", info.compress_type))
    return copy.getvalue()


base = torch.arange(24.0).reshape(4, 6)
STORED = {  # tensor, and whether its storage holds exactly it in row-major order
    "float32": (base, True),
    "bfloat16": (base.to(torch.bfloat16), True),
    "int64": (torch.arange(7), True),
    "bool": (torch.tensor([True, False, True]), True),
    "scalar": (torch.tensor(3.5), True),
    "size-1 dim": (torch.ones(3, 1, 2), True),
    "transposed": (base.t(), False),
    "a view behind an offset": (base[1:], False),
    "a slice of a larger storage": (base[:2], False),
}


@pytest.mark.parametrize("tensor, whole", STORED.values(), ids=STORED.keys())
def test_a_stored_tensors_header_says_what_torch_load_says(tensor, whole):
    """compat.torch.stored_tensor parses what torch.load parses (onto the meta device), without
    torch: the direct read trusts its dtype, shape, strides and where the bytes start."""
    from nlq_scale.compat.megatron_load import _Window
    from nlq_scale.compat.torch import stored_tensor

    item = saved(tensor)
    file = io.BytesIO(b"x" * 100 + item)  # the item behind other items in its file, as in a .distcp
    stored = stored_tensor(_Window(file, 100, len(item)))
    meta = torch.load(io.BytesIO(item), map_location="meta", weights_only=True)
    assert (stored.dtype, stored.shape, stored.stride) == (meta.dtype, tuple(meta.shape), meta.stride())
    assert stored.storage_offset == meta.storage_offset()
    assert stored.storage_nbytes == meta.untyped_storage().nbytes() == tensor.untyped_storage().nbytes()
    assert stored.data_offset == meta.untyped_storage()._checkpoint_offset
    assert stored.little_endian == (sys.byteorder == "little") and stored.is_whole_contiguous() == whole
    at = 100 + stored.data_offset
    assert file.getvalue()[at : at + stored.storage_nbytes] == bytes(tensor.untyped_storage())


NOT_ONE_TENSOR = {
    "a parameter": saved(torch.nn.Parameter(base)),
    "a dict of tensors": saved({"w": base}),
    "compressed records": rewritten(saved(base), compression=zipfile.ZIP_DEFLATED),
    "an unknown byte order": rewritten(saved(base), byteorder=b"middle"),
    "not a zip archive": b"PK" + bytes(200),
}


@pytest.mark.parametrize("item", NOT_ONE_TENSOR.values(), ids=NOT_ONE_TENSOR.keys())
def test_a_stored_tensors_header_is_none_for_anything_else(item):
    """What stored_tensor does not read whole is left to torch's reader."""
    from nlq_scale.compat.torch import stored_tensor

    assert stored_tensor(io.BytesIO(item)) is None


def test_an_item_saved_big_endian_is_not_read_directly():
    """torch.save records the host's byte order; only a little-endian item's bytes may be read raw
    (torch.load swaps the others)."""
    from nlq_scale.compat.torch import stored_tensor

    stored = stored_tensor(io.BytesIO(rewritten(saved(base), byteorder=b"big")))
    assert stored is not None and not stored.little_endian


def test_a_window_reads_and_seeks_only_its_own_bytes():
    from nlq_scale.compat.megatron_load import _Window

    window = _Window(io.BytesIO(bytes(range(20))), 5, 10)
    assert window.read() == bytes(range(5, 15))
    assert window.seek(-3, io.SEEK_END) == 7 and window.read(2) == bytes([12, 13])
    assert window.seek(2) == 2 and window.read(100) == bytes(range(7, 15)) and window.read() == b""
    with pytest.raises(ValueError, match="negative seek"):
        window.seek(-11, io.SEEK_END)


def test_a_load_zeroes_no_padding_where_the_stored_shape_is_the_same():
    """megatron zeroes a tensor that may be stored in another shape (the padded vocabulary's)
    before reading into it; the engine clears that only where the checkpoint holds the same shape."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties, TensorStorageMetadata

    from nlq_scale.train.engine_megatron import _no_padding_where_shapes_match

    def sharded(key: str, rows: int, mismatch: bool) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets(key, torch.ones(rows, 4), allow_shape_mismatch=mismatch)

    ours = {
        "model": {"same": sharded("same", 8, True), "fixed": sharded("fixed", 8, False)},
        "optimizer": [sharded("more rows stored", 8, True), sharded("not stored", 8, True)],
    }
    def metadata(rows: int) -> TensorStorageMetadata:  # what torch.distributed.checkpoint stores of a tensor
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, 4]), [])

    stored = {"same": metadata(8), "fixed": metadata(8), "more rows stored": metadata(16), "an object": BytesStorageMetadata()}
    _no_padding_where_shapes_match(ours, stored)
    flags = {t.key: t.allow_shape_mismatch for t in [*ours["model"].values(), *ours["optimizer"]]}
    assert flags == {"same": False, "fixed": False, "more rows stored": True, "not stored": True}
    assert all(t.data.eq(1).all() for t in [*ours["model"].values(), *ours["optimizer"]])  # nothing read or zeroed


@pytest.fixture
def planned_loads() -> Iterator[list[int]]:
    """Loads that went through megatron's torch_dist strategy (the rank script's count)."""
    from tests.scripts.megatron_load import planned_loads as counted

    calls: list[int] = []
    with counted(calls):
        yield calls


def saved_engine(tmp_path, overrides: list[str]):
    """A megatron engine trained two steps and saved into tmp_path/ckpt, and its state then."""
    from tests.scripts import deepspeed_engine as s
    from tests.scripts.megatron_load import state

    cfg = s.config(overrides)
    engine = s.megatron_engine(cfg)
    s.train(engine, cfg, s.batches(cfg, 2, seed=1), 0)
    (tmp_path / "ckpt").mkdir()
    engine.save(tmp_path / "ckpt")
    return engine, state(engine)


@pytest.mark.parametrize("staged", [False, True], ids=["into the targets", "through host memory"])
def test_a_load_in_the_saved_layout_reads_every_tensor_without_planning(single_rank, tmp_path, planned_loads, monkeypatch, staged):
    """Saved and loaded at one layout (MoE experts and all), each tensor reads its own stored
    chunk, with no resharding plan, and the engine holds again every bit it saved, after training
    on other data in between. Read as a device target is (through reused host memory, then
    copied), on CPU targets here, too."""
    from nlq_scale.compat import megatron_load
    from tests.scripts import deepspeed_engine as s
    from tests.scripts.megatron_load import differing_bits, state

    monkeypatch.setattr(megatron_load, "_staged", lambda target: staged)

    overrides = ["model.moe.num_experts=2"]
    engine, expected = saved_engine(tmp_path, overrides)
    cfg = s.config(overrides)
    s.train(engine, cfg, s.batches(cfg, 2, seed=7), 2)
    engine.load(tmp_path / "ckpt")
    loaded = state(engine)
    assert planned_loads == []
    assert loaded.keys() == expected.keys()
    assert differing_bits(expected, loaded) == []


def test_a_load_in_another_layout_goes_through_megatrons_resharding(single_rank, tmp_path, planned_loads):
    """A vocabulary padded otherwise than the checkpoint's stores the embedding in another shape:
    that load is megatron's, which pads."""
    from tests.scripts import deepspeed_engine as s

    engine, _ = saved_engine(tmp_path, [])  # vocabulary 1000, padded to a multiple of 8: 1000 rows
    other = s.megatron_engine(s.config(["model.make_vocab_size_divisible_by=64"]))  # 1024 rows
    other.load(tmp_path / "ckpt")
    assert planned_loads == [1]
    vocab = engine.cfg.model.vocab_size
    ours, theirs = (e.model.module.embedding.word_embeddings.weight[:vocab] for e in (engine, other))
    assert torch.equal(ours, theirs)


def test_a_load_of_other_shapes_fails_as_megatrons_does(single_rank, tmp_path, planned_loads):
    """A model whose MLP is wider (its embedding, which megatron may pad, the same) does not read
    the checkpoint's chunks as its own: megatron's load refuses it, naming the mismatch."""
    from torch.distributed.checkpoint.api import CheckpointException

    from tests.scripts import deepspeed_engine as s

    saved_engine(tmp_path, [])
    wider = s.megatron_engine(s.config(["model.ffn_hidden_size=512"]))
    with pytest.raises(CheckpointException, match="Global shape mismatch"):
        wider.load(tmp_path / "ckpt")
    assert planned_loads == [1]


def test_background_saves_write_the_state_they_were_started_at(single_rank, tmp_path, monkeypatch):
    """Two background saves, each with its write held back until a training step has changed the
    parameters and Adam moments in place: each writes the bits a synchronous save at its start
    wrote, since whatever shares memory with the state was copied at the start, into the same
    host memory both times. The copies megatron made itself (of the views it clones) are written
    as they are, not copied again."""
    from nlq_scale.compat import megatron_save
    from nlq_scale.train import engine_megatron
    from nlq_scale.train.writers import ThreadWriter
    from tests.scripts import deepspeed_engine as s
    from tests.scripts.megatron_load import checkpoint_tensors, differing_bits

    release, snapshots = threading.Event(), []

    class HeldBack(ThreadWriter):
        def __init__(self, write, results) -> None:
            super().__init__(lambda: (release.wait(), write()), results)

    def snapshot(self, key, tensor, live):
        copy = original(self, key, tensor, live)
        snapshots[-1].append(None if copy is tensor else copy.data_ptr())
        return copy

    original = megatron_save.HostCopies.snapshot
    monkeypatch.setitem(engine_megatron.WRITERS, "thread", HeldBack)
    monkeypatch.setattr(megatron_save.HostCopies, "snapshot", snapshot)
    cfg = s.config([])
    engine, _ = saved_engine(tmp_path, [])  # trained two steps, saved synchronously into tmp_path/ckpt
    for save in range(2):
        want, got = tmp_path / f"ckpt{save or ''}", tmp_path / f"background{save}"
        if save:
            s.train(engine, cfg, s.batches(cfg, 1, seed=8), 3)
            want.mkdir()
            engine.save(want)
        got.mkdir()
        release.clear()
        snapshots.append([])
        engine.save(got, background=True)
        s.train(engine, cfg, s.batches(cfg, 1, seed=7), 2 + 2 * save)
        release.set()
        assert engine.save_written(blocking=True)
        want, got = checkpoint_tensors(want), checkpoint_tensors(got)
        assert want.keys() == got.keys()
        assert differing_bits(want, got) == []
    copied = [[at for at in save if at is not None] for save in snapshots]
    assert 0 < len(copied[0]) < len(snapshots[0])  # megatron's own clones (the model's views into its buffers) pass as they are
    assert copied[0] == copied[1]  # into the same memory
