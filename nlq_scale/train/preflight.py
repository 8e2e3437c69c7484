"""Checks before any rank starts: bad input fails here, once, with exit 2 and nothing written."""

from __future__ import annotations

from pathlib import Path

from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import UsageError
from nlq_scale.runtime.device import resolve_device
from nlq_scale.runtime.kernels import probe
from nlq_scale.train.rundir import claim


def preflight(cfg: RunConfig, run_dir: Path, world_size: int, local_rank: int = 0) -> None:
    from nlq_scale.data.loader import dataset_manifest_sha256

    resolve_device(cfg.runtime.device, local_rank)  # CUDA asked for and missing: stop before anything
    if cfg.model.transformer_impl == "transformer_engine" and not probe().transformer_engine:
        raise UsageError(
            "model.transformer_impl=transformer_engine: Transformer Engine is not installed "
            "(pip install 'nlq-scale[gpu]' on a CUDA node, or use transformer_impl=local)"
        )
    try:
        cfg.check_world(world_size)
    except ValueError as e:
        raise UsageError(f"layout: {e}") from None
    if cfg.data.path is None and cfg.data.streams is None:
        raise UsageError("data.path: no prepared dataset given (nlq-scale prepare-data, then data.path=DIR)")
    dataset_manifest_sha256(cfg.data)  # raises UsageError naming a missing/unprepared dataset
    claim(run_dir, cfg)
