"""The megatron engine saves the optimizer state from its own tensors and loads it into them,
writes in its own process and reads stored tensors straight into their targets (compat.megatron):
it must write the very checkpoint megatron's own save writes, in the background too, without
forking; restore the very bits megatron's own load restores (at the layout the checkpoint was
saved at and at others); and read less through torch."""

import io
import json
import sys
import zipfile

import pytest
import torch

from tests.conftest import run_ranks


def run(tmp_path, mode: str, nproc: int, *overrides: str) -> dict:
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    out = tmp_path / f"{mode}-{nproc}.json"
    run_ranks("megatron_load.py", nproc, mode, str(out), "--dir", str(tmp_path / "ckpt"), *overrides)
    return json.loads(out.read_text())


def assert_same_bits(result: dict) -> None:
    for rank in result["ranks"]:
        assert rank["keys"] > 0 and rank["differ"] == [], rank
        assert rank["torch_reads"]["in_place"] < rank["torch_reads"]["megatron"], rank


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
    saved = run(tmp_path, "save", save_n, *save_at)
    assert any(".optimizer.state.exp_avg." in f".{k}" for k in saved["keys"]), saved["keys"]
    for way in ("ours", "background"):
        assert saved[way] == {"not_in_both": [], "differ": []}, (way, saved)
    # Written in this process (no writer processes forked), where megatron's own writer forks.
    assert saved["forks"]["ours"] == saved["forks"]["background"] == 0 < saved["forks"]["megatron"], saved["forks"]
    for load_n, load_at in loads:
        loaded = run(tmp_path, "compare", load_n, *load_at)
        assert_same_bits(loaded)
        assert any(rank["split"] for rank in loaded["ranks"]) == (load_n == 2)  # DP=2 splits some parameter


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
    from nlq_scale.compat.megatron import _Window
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
    from nlq_scale.compat.megatron import _Window

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

    from nlq_scale.train.engine_megatron import _no_padding_where_shapes_match

    def sharded(key: str, rows: int, mismatch: bool) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets(key, torch.ones(rows, 4), allow_shape_mismatch=mismatch)

    ours = {
        "model": {"same": sharded("same", 8, True), "fixed": sharded("fixed", 8, False)},
        "optimizer": [sharded("more rows stored", 8, True), sharded("not stored", 8, True)],
    }
    stored = {"same": sharded("same", 8, False), "fixed": sharded("fixed", 8, False),
              "more rows stored": sharded("more rows stored", 16, False)}  # fmt: skip
    _no_padding_where_shapes_match(ours, stored)
    flags = {t.key: t.allow_shape_mismatch for t in [*ours["model"].values(), *ours["optimizer"]]}
    assert flags == {"same": False, "fixed": False, "more rows stored": True, "not stored": True}
    assert all(t.data.eq(1).all() for t in [*ours["model"].values(), *ours["optimizer"]])  # nothing read or zeroed
