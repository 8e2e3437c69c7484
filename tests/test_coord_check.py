"""The coordinate check (`nlq-scale coord-check`, nlq_scale.model.coord): its verdict passes every
arm under muP and the standard parametrization's drift, fails on injected muP mistakes, and its
command line writes what it says."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nlq_scale import arms
from nlq_scale.model import mup


@pytest.mark.slow
@pytest.mark.parametrize("arm", arms.names())
def test_coord_check_passes_every_arm(single_rank, arm):
    """The check's verdict as `nlq-scale coord-check --check` reads it: under muP every arm is flat at
    init (the readout at -1/2), grows nowhere and falls no faster than width^-1/2 after training;
    under the standard parametrization (one seed) the hidden outputs grow with width. Seeds 1-4, half
    the default's time: every arm passes at 1-4 as at 1-8 and 9-16 (docs/mup.md has the margins)."""
    from nlq_scale.model import coord

    result = coord.check(coord.CoordCheckSpec(arm=arm, parametrizations=("mup",), seeds=(1, 2, 3, 4)))
    mup_ = result["parametrizations"]["mup"]
    assert all(result["verdict"].values()), {k: mup_[k] for k in ("growth", "decay", "init", "readout_init_slope")}
    assert {"output_layer", "self_attention.attention_logits", "self_attention.attention_q", "self_attention.attention_k",
            "mlp.linear_fc2"} <= set(mup_["modules"])  # fmt: skip
    standard = coord.check(coord.CoordCheckSpec(arm=arm, parametrizations=("standard",), seeds=(1,)))
    assert standard["verdict"] == {"standard_drifts": True}
    assert standard["parametrizations"]["standard"]["max_abs_slope"] > 1.0


def _declared_vector(name: str):
    """param_class with one of an arm's matrices declared a vector, as a wrong `weight_names` would."""
    real = mup.param_class

    def param_class(m, param, ndim):
        return "vector" if name in param else real(m, param, ndim)

    return param_class


def _hidden_lr(power: float):
    """group_multipliers with the hidden matrices' lr at 1/w**power (muP: power 1)."""
    real = mup.group_multipliers

    def group_multipliers(m, t):
        groups = real(m, t)
        groups["hidden"]["lr_mult"] = mup.width_multiplier(m) ** -power
        return groups

    return group_multipliers


def _logits_multiplier(power: float):
    """megatron_fields with the logits at w**power (muP: power -1, megatron's default)."""
    real = mup.megatron_fields

    def megatron_fields(m):
        return {**real(m), "mup_output_mult": mup.width_multiplier(m) ** power}

    return megatron_fields


MISTAKES = {  # a muP mistake -> (what to patch, the verdict part that must fail)
    "W1-declared-a-vector": ("param_class", lambda: _declared_vector("query.f.up"), "mup_no_growth"),
    "hidden-lr-1/w^2": ("group_multipliers", lambda: _hidden_lr(2.0), "mup_decay_bounded"),
    "logits-x-1/sqrt(w)": ("megatron_fields", lambda: _logits_multiplier(-0.5), "mup_init_flat"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", MISTAKES)
def test_coord_check_catches_a_wrong_power_of_width(single_rank, monkeypatch, mistake):
    """Each part of the muP verdict fails on the kind of mistake it is there for (docs/mup.md has
    seven more): an arm matrix at the base learning rate grows, a learning rate scaled twice falls
    as 1/w, and logits scaled by 1/sqrt(w) stay flat at init. One seed: each misses its threshold
    by 0.4 or more (measured with four)."""
    from nlq_scale.model import coord

    attribute, patched, fails = MISTAKES[mistake]
    monkeypatch.setattr(mup, attribute, patched())
    result = coord.check(coord.CoordCheckSpec(arm="nonlinear", parametrizations=("mup",), seeds=(1,)))
    assert result["verdict"][fails] is False, result["parametrizations"]["mup"][
        {"mup_no_growth": "growth", "mup_decay_bounded": "decay", "mup_init_flat": "init"}[fails]
    ]


def test_the_mup_verdict_reads_init_growth_and_fall():
    """The verdict from the slopes alone: every part passes at the thresholds' inner side and each
    fails alone when its own slope crosses."""
    from nlq_scale.model import coord

    def result(init=0.05, readout=-0.45, act=0.0, upd=0.0):
        modules = {
            "mlp.linear_fc2": {"init_slope": init, "slope": act, "update_slope": upd},
            coord.READOUT: {"init_slope": readout, "slope": 0.0, "update_slope": 0.0},
        }
        for m in modules.values():
            m.update({f"{k}_interval": None for k in ("init_slope", "slope", "update_slope")})
        return coord.verdict({"parametrizations": {"mup": coord._summarize(modules)}})

    parts = {"mup_init_flat", "mup_no_growth", "mup_decay_bounded"}
    assert result() == dict.fromkeys(parts, True)
    assert result(act=-0.45, upd=0.09) == dict.fromkeys(parts, True)  # a finite-width fall passes
    for kwargs, fails in [({"init": 0.12}, "mup_init_flat"), ({"readout": -0.38}, "mup_init_flat"),
                          ({"readout": -0.62}, "mup_init_flat"), ({"act": 0.11}, "mup_no_growth"),
                          ({"upd": -0.55}, "mup_decay_bounded")]:  # fmt: skip
        assert result(**kwargs) == {p: p != fails for p in parts}, kwargs


def test_a_slopes_interval_is_the_spread_over_seeds():
    """The seed bootstrap: curves that differ between seeds only by a constant factor give every
    resample the same slope; seed-to-seed noise widens the interval around the point estimate;
    one seed gives none."""
    from nlq_scale.model.coord import slope, slope_interval

    widths = [64, 128, 256, 512]
    exact = np.array([[c * w**-0.5 for w in widths] for c in (1.0, 2.0, 3.0)])  # [seed, width]
    assert slope_interval(widths, exact) == pytest.approx([-0.5, -0.5])
    noisy = exact * np.random.default_rng(1).lognormal(0.0, 0.3, exact.shape)
    lo, hi = slope_interval(widths, noisy)
    assert lo < slope(widths, list(noisy.mean(axis=0))) < hi and hi - lo > 0.05
    assert slope_interval(widths, exact[:1]) is None


def test_coord_check_cli_writes_json_and_plot(tmp_path):
    from tests.conftest import cli

    png = tmp_path / "c.png"
    r = cli("coord-check", "--arm", "nonlinear", "--widths", "32,64", "--steps", "1", "--seeds", "1",
            "--parametrization", "mup", "--png", str(png), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    modules = result["parametrizations"]["mup"]["modules"]
    assert {"self_attention.query.f.up", "self_attention.query.f.down", "self_attention.query.norm_in"} <= set(modules)
    assert all(isinstance(m[k], float) and m[f"{k}_interval"] is None  # one seed
               for m in modules.values() for k in ("init_slope", "slope", "update_slope"))  # fmt: skip
    assert set(result["verdict"]) == {"mup_init_flat", "mup_no_growth", "mup_decay_bounded"}
    assert result["parametrizations"]["mup"]["steepest"]["module"] in modules
    assert png.stat().st_size > 0 and result["png"] == str(png)


@pytest.mark.parametrize(
    "args, message",
    [(["--widths", "64,100"], "--widths"), (["--parametrization", "mu"], "--parametrization"),
     (["--steps", "0"], "--steps"), (["--arm", "bogus"], "bogus")],
)  # fmt: skip
def test_coord_check_bad_arguments_exit_2(args, message):
    from tests.conftest import refused

    base = {"--arm": "linear"}
    assert message in refused("coord-check", *[x for k, v in base.items() if k not in args for x in (k, v)], *args)
