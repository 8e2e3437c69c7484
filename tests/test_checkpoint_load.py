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


def test_an_item_saved_big_endian_is_not_read_directly():
    """torch.save records the host's byte order; only a little-endian item's bytes may be read raw
    (torch.load swaps the others)."""
    from nlq_scale.compat.megatron import _saved_little_endian, _Window

    item = io.BytesIO()
    torch.save(torch.arange(4.0), item)
    item = item.getvalue()
    file = io.BytesIO(b"x" * 100 + item)  # the item behind other items in its file, as in a .distcp
    assert _saved_little_endian(_Window(file, 100, len(item))) == (sys.byteorder == "little")

    swapped = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(item)) as original, zipfile.ZipFile(swapped, "w") as copy:
        for info in original.infolist():
            copy.writestr(info, b"big" if info.filename.endswith("/byteorder") else original.read(info))
    assert not _saved_little_endian(_Window(swapped, 0, len(swapped.getvalue())))


def test_a_window_reads_and_seeks_only_its_own_bytes():
    from nlq_scale.compat.megatron import _Window

    window = _Window(io.BytesIO(bytes(range(20))), 5, 10)
    assert window.read() == bytes(range(5, 15))
    assert window.seek(-3, io.SEEK_END) == 7 and window.read(2) == bytes([12, 13])
    assert window.seek(2) == 2 and window.read(100) == bytes(range(7, 15)) and window.read() == b""
    with pytest.raises(ValueError, match="negative seek"):
        window.seek(-11, io.SEEK_END)
