"""Sweep files: schema, expansion into runs with stable ids, layering of settings, bad input."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from nlq_scale.cluster.sweep import expand, load_sweep, run_id_for
from nlq_scale.errors import UsageError
from nlq_scale.model.accounting import count_parameters
from tests.conftest import nlq
from tests.test_cluster_jobs import TEST_SWEEP, prepare_text_dataset


def write_sweep(tmp_path, **fields):
    base = {
        "name": "s",
        "scales": ["cpu-xs"],
        "arms": ["linear"],
        "data": {"path": str(tmp_path / "data"), "seed": 7},
        "cluster": "local-slurm",
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(base | fields))
    return path


def test_grid_expands_in_a_stable_order_with_readable_unique_ids(tmp_path):
    path = write_sweep(
        tmp_path,
        scales=["cpu-xs", "cpu-s"],
        arms=["linear", {"name": "nonlinear", "lrs": [1e-3, 3e-3]}],
        seeds=[1, 2],
        lrs=[6e-4],
    )
    specs = expand(load_sweep(path))
    ids = [s.run_id for s in specs]
    assert ids[:6] == [
        "cpu-xs-linear-s1-lr0.0006",
        "cpu-xs-linear-s2-lr0.0006",
        "cpu-xs-nonlinear-s1-lr0.001",
        "cpu-xs-nonlinear-s1-lr0.003",
        "cpu-xs-nonlinear-s2-lr0.001",
        "cpu-xs-nonlinear-s2-lr0.003",
    ]
    assert len(ids) == 12 and len(set(ids)) == 12
    assert ids == [s.run_id for s in expand(load_sweep(path))]  # stable across expansions
    for s in specs:
        assert (s.cfg.name, s.cfg.sweep, s.cfg.scale, s.cfg.variant) == (s.run_id, "s", s.scale, s.arm)
        assert (s.cfg.seed, s.cfg.train.lr, s.cfg.data.seed) == (s.seed, s.lr, 7)
        assert s.run_dir(tmp_path) == tmp_path / "s" / s.run_id


def test_default_lr_is_the_scales_and_ids_are_sanitised(tmp_path):
    (spec,) = expand(load_sweep(write_sweep(tmp_path, arms=["linear-mlp4.75"])))
    assert spec.lr == 3e-3 and spec.run_id == "cpu-xs-linear-mlp4.75-s1234-lr0.003"
    assert run_id_for("1.3b", "a/b c", 1, 1e-5) == "1.3b-a-b-c-s1-lr1e-05"


def test_settings_layer_scale_arm_sweep_arm_overrides_cli(tmp_path):
    path = write_sweep(
        tmp_path,
        arms=[{"name": "linear", "overrides": {"train.warmup_steps": 3}}, "nonlinear"],
        engine="deepspeed",
        parallel={"zero_stage": 2, "recompute": "selective"},
        wandb_project="proj",
        overrides={"train": {"warmup_steps": 5, "weight_decay": 0.0}, "checkpoint.every": 4},
    )
    lin, nl = expand(load_sweep(path), ["train.weight_decay=0.05"])
    assert lin.cfg.train.warmup_steps == 3 and nl.cfg.train.warmup_steps == 5  # arm beats sweep
    assert lin.cfg.train.weight_decay == 0.05  # the command line beats both
    assert nl.cfg.model.arm == "nonlinear" and nl.cfg.model.hidden_size == 64  # arm + scale files
    assert (nl.cfg.train.engine, nl.cfg.train.zero_stage, nl.cfg.parallel.recompute) == ("deepspeed", 2, "selective")
    assert nl.cfg.logging.wandb_project == "proj" and nl.cfg.checkpoint.every == 4


def test_horizon_in_tokens_or_tokens_per_parameter(tmp_path):
    (fixed,) = expand(load_sweep(write_sweep(tmp_path, horizon={"tokens": 10000})))
    assert fixed.cfg.train.steps == 20  # ceil(10000 / (8 x 64))
    (chin,) = expand(load_sweep(write_sweep(tmp_path, horizon={"tokens_per_param": 0.5})))
    n = count_parameters(chin.cfg.model).non_embedding
    assert chin.cfg.train.steps == math.ceil(math.ceil(0.5 * n) / (8 * 64))
    (cli,) = expand(load_sweep(write_sweep(tmp_path, horizon={"tokens": 10000})), ["train.steps=12"])
    assert cli.cfg.train.steps == 12  # a command-line train.steps replaces the horizon


def test_data_paths_become_absolute_and_streams_are_allowed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, data={"streams": [{"path": "a", "proportion": 0.7},
                                                   {"path": "b", "proportion": 0.3}]})
    (spec,) = expand(load_sweep(path))
    assert [s.path for s in spec.cfg.data.streams] == [str(tmp_path / "a"), str(tmp_path / "b")]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"arms": ["linear", "quadratic"]}, "arms.1: unknown arm 'quadratic'"),
        ({"scales": ["9t"]}, "scales.0: unknown scale '9t'"),
        ({"lrs": [0.0]}, "lrs.0: Input should be greater than 0"),
        ({"arms": [{"name": "linear", "lrs": [-1.0]}]}, "arms.0.lrs.0: Input should be greater than 0"),
        ({"lrs": []}, "lrs: List should have at least 1 item"),  # not each scale's own LR, silently
        ({"arms": [{"name": "linear", "lrs": []}]}, "arms.0.lrs: List should have at least 1 item"),
        ({"overrides": {"train.lr": -1}}, "train.lr: Input should be greater than 0"),
        ({"overrides": {"train.nonsense": 1}}, "train.nonsense: unknown key"),
        ({"horizon": {"tokens": 10, "tokens_per_param": 20}}, "exactly one of horizon.tokens"),
        ({"horizon": {"tokens": 10000}, "overrides": {"train.steps": 5}}, "give horizon or train.steps"),
        ({"data": {"path": "x", "streams": [{"path": "y", "proportion": 1}]}}, "exactly one of data.path"),
        ({"lrs": [1e-3, 1.0000001e-3]}, "occurs twice"),
        ({"name": "../escape"}, "must be a plain name"),
        ({"surprise": 1}, "surprise: unknown key"),
    ],
)
def test_bad_sweeps_are_usage_errors_naming_the_field(tmp_path, fields, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        expand(load_sweep(write_sweep(tmp_path, **fields)))


@pytest.mark.slow
def test_submit_validates_data_and_dry_run_lists_without_submitting(tmp_path):
    root = tmp_path / "runs"

    def submit(*args):
        return nlq("submit", str(TEST_SWEEP), "--root", str(root), "--dry-run", "--json", *args)

    out = submit(f"data.path={tmp_path / 'missing'}")
    assert out.returncode == 2 and "data.path" in out.stderr and "no such dataset directory" in out.stderr
    prepared = prepare_text_dataset(tmp_path)
    out = submit(f"data.path={prepared}", "model.seq_length=32")
    assert out.returncode == 2 and "prepared with --seq-len 64, but model.seq_length is 32" in out.stderr
    out = submit(f"data.path={prepared}", "data.val_sequences=4096")
    assert out.returncode == 2 and "data.val_sequences: the validation split holds" in out.stderr
    out = submit(f"data.path={prepared}", f"data.validation=[{{name: again, path: {prepared}, sequences: 4096}}]")
    assert out.returncode == 2 and "data.validation.0.sequences: the validation split holds" in out.stderr
    out = submit(f"data.path={prepared}")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [(r["action"], r["nodes"], r["tasks_per_node"], r["job_id"]) for r in doc["runs"]] == [
        ("submit", 2, 1, None), ("submit", 2, 1, None)]
    assert not root.exists()
