"""Scaling-law fits: known parameters recovered from noisy synthetic points, refusal when the data
cannot determine a fit, and the Chinchilla approach-3 reproduction of Epoch AI's replication."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nlq_scale.analysis import fits
from nlq_scale.cli import main

CHINCHILLA = Path(__file__).resolve().parents[2] / "shared" / "reference" / "chinchilla" / "svg_extracted_data.csv"


def test_power_law_recovers_known_parameters_from_noisy_points():
    rng = np.random.default_rng(1)
    x = np.geomspace(1e15, 1e20, 7)
    E, A, alpha = 1.9, 2.0e3, 0.2
    y = E + A * x**-alpha + rng.normal(0, 0.002, x.size)
    law = fits.fit_power_law(x, y)
    assert law.E == pytest.approx(E, abs=0.03)
    assert law.alpha == pytest.approx(alpha, rel=0.05)
    assert np.max(np.abs(law(x) - y)) < 0.006
    # the inverse reads the law backwards
    assert law.inverse(float(law(3e17))) == pytest.approx(3e17, rel=1e-9)
    assert law.inverse(law.E - 0.1) == np.inf


def test_batch_fit_matches_single_fits_row_by_row():
    rng = np.random.default_rng(2)
    x = np.geomspace(1e6, 1e9, 5)
    Y = 2.5 + 40 * x**-0.3 + rng.normal(0, 0.003, (4, 5))
    E, A, alpha, ok = fits.fit_power_law_batch(x, Y)
    assert ok.all()
    for i, row in enumerate(Y):
        law = fits.fit_power_law(x, row)
        assert (law.E, law.A, law.alpha) == pytest.approx((E[i], A[i], alpha[i]), rel=1e-9)


def test_power_law_refuses_what_the_data_cannot_determine():
    x = np.array([1e15, 1e16, 1e17, 1e18])
    with pytest.raises(fits.NotIdentifiable, match="needs at least 3"):
        fits.fit_power_law(x[:2], [3.0, 2.9])
    with pytest.raises(fits.NotIdentifiable, match="does not decrease"):
        fits.fit_power_law(x, [2.5, 2.6, 2.7, 2.8])


def test_chinchilla_recovers_synthetic_parameters():
    rng = np.random.default_rng(3)
    N = np.repeat(np.geomspace(5e7, 5e9, 8), 6)
    D = np.tile(np.geomspace(5e9, 5e11, 6), 8)
    truth = fits.ChinchillaFit(E=1.7, A=400.0, B=1500.0, alpha=0.33, beta=0.29, objective=0.0, n_points=N.size)
    L = truth(N, D) * np.exp(rng.normal(0, 0.002, N.size))
    fit = fits.fit_chinchilla(N, D, L)
    assert fit.E == pytest.approx(1.7, rel=0.05)
    assert fit.alpha == pytest.approx(0.33, rel=0.1)
    assert fit.beta == pytest.approx(0.29, rel=0.1)
    boots = fits.bootstrap_chinchilla(N, D, L, fit, resamples=30, seed=0)
    alphas = np.array([b.alpha for b in boots])
    assert alphas.std() > 0  # the resamples really differ
    assert np.percentile(alphas, 2.5) < 0.33 < np.percentile(alphas, 97.5)


@pytest.mark.skipif(not CHINCHILLA.is_file(), reason=f"reference data absent: {CHINCHILLA}")
def test_chinchilla_approach3_reproduces_epoch_replication(capsys):
    rc = main([
        "fit", "--csv", str(CHINCHILLA), "--params-col", "Model Size", "--flops-col", "Training FLOP",
        "--loss-col", "loss", "--drop-highest", "5", "--json",
    ])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    fit = out["fit"]
    assert out["n_points"] == 240
    # the best fit (shared/reference/README.md) ...
    assert fit["E"] == pytest.approx(1.817, rel=0.01)
    assert fit["A"] == pytest.approx(478, rel=0.02)
    assert fit["B"] == pytest.approx(2143, rel=0.02)
    assert fit["alpha"] == pytest.approx(0.347, rel=0.01)
    assert fit["beta"] == pytest.approx(0.367, rel=0.01)
    # ... is within a few percent of Epoch AI's published estimates
    epoch = {"E": 1.82, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}
    for key, value in epoch.items():
        assert fit[key] == pytest.approx(value, rel=0.04), key
