"""Scaling-law fits.

- `fit_power_law`: L(x) = E + A * x^(-alpha), x = training compute C or non-embedding params N.
  Variable projection: for a fixed alpha the model is linear in (E, A), so least squares over
  (E, A) is closed form and only alpha is searched (a log-spaced grid refined by one parabolic
  step). The same code fits thousands of bootstrap resamples at once, which keeps CIs cheap.
- `fit_chinchilla`: Hoffmann et al.'s approach 3, L(N, D) = E + A/N^alpha + B/D^beta, fitted as
  a Huber loss (delta = 1e-3) on log L, with L-BFGS-B from a grid of starts (the objective is
  written in log-sum-exp form with an analytic gradient, as in the paper and Epoch AI's
  replication). Every setting (delta, loss space, start grid, tolerances) is a `FitSettings`.
- Both say when the points do not determine the fit: a parameter on its bound (E ~ 0, an
  exponent <= 0, a term the data never see) or an optimum that is flat in some direction.
  `docs/analysis.md` gives the criteria.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats
from scipy.optimize import minimize

ALPHA_GRID = np.geomspace(1e-3, 5.0, 1500)
MIN_POINTS = 3  # three parameters
# E below this fraction of the lowest observed loss has collapsed onto its bound 0
E_FLOOR = 0.01
# a parameter free to move by this factor inside its likelihood region is not determined by the points
FLAT_FACTOR = 10.0


class NotIdentifiable(Exception):
    """The data do not determine the fit; the message says why."""


@dataclass(frozen=True)
class PowerLaw:
    """L(x) = E + A * x^(-alpha)."""

    E: float
    A: float
    alpha: float
    n_points: int
    x_min: float
    x_max: float

    def __call__(self, x: np.ndarray | float) -> np.ndarray | float:
        return self.E + self.A * np.power(x, -self.alpha)

    def inverse(self, loss: float) -> float:
        """The x at which the law reaches `loss`; +inf when loss is at or below the asymptote E."""
        return float(inverse_batch(np.array([self.E]), np.array([self.A]), np.array([self.alpha]), np.array([loss]))[0])

    def as_dict(self) -> dict:
        return asdict(self)


def fit_power_law(x: np.ndarray, y: np.ndarray) -> PowerLaw:
    """Least-squares L(x) = E + A x^-alpha through points (x, y); raises NotIdentifiable."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    _check_points(x)
    E, A, alpha, ok = fit_power_law_batch(x, y[None, :])
    if not ok[0]:
        raise NotIdentifiable(_failure_reason(x, y))
    return PowerLaw(float(E[0]), float(A[0]), float(alpha[0]), len(x), float(x.min()), float(x.max()))


def _check_points(x: np.ndarray) -> None:
    distinct = len(np.unique(x))
    if distinct < MIN_POINTS:
        raise NotIdentifiable(
            f"{distinct} distinct point(s); E + A*x^-alpha has 3 parameters and needs at least {MIN_POINTS}"
        )
    if np.any(~np.isfinite(x)) or np.any(x <= 0):
        raise NotIdentifiable("x must be positive and finite at every point")


def _failure_reason(x: np.ndarray, y: np.ndarray) -> str:
    E, A, alpha = _profile(x, y[None, :])
    if A[0] <= 0:
        return "loss does not decrease with x (best fit has A <= 0)"
    return f"best alpha sits on the search bound ({alpha[0]:.3g}); the curvature is not determined"


def power_law_flags(x: np.ndarray, y: np.ndarray, law: PowerLaw, level: float = 0.95) -> list[str]:
    """Why the points do not determine a law although a best fit exists: E at or below its bound 0,
    or alpha's profile interval (the F-test of nonlinear least squares) reaching the search bound or
    spanning more than FLAT_FACTOR. The profile needs 2 residual degrees of freedom (5 points): with
    one, F(1, 1) lets the residuals grow 161-fold and every alpha passes; the seed bootstrap's
    interval is then the only check."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    out = []
    if law.E < E_FLOOR * y.min():
        out.append(f"E = {law.E:.3g} is at or below its bound 0")
    dof = len(x) - 3
    if dof < 2:
        return out
    sse = _sse(x / np.exp(np.log(x).mean()), y[None, :], ALPHA_GRID)[0]
    inside = ALPHA_GRID[sse <= sse.min() * (1 + stats.f.ppf(level, 1, dof) / dof)]
    lo, hi = inside.min(), inside.max()
    if lo <= ALPHA_GRID[0] or hi >= ALPHA_GRID[-1] or hi / lo > FLAT_FACTOR:
        out.append(f"the residuals hardly change along alpha (its {level:.0%} profile interval is "
                   f"[{lo:.3g}, {hi:.3g}])")
    return out


def fit_power_law_batch(x: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fit every row of Y (shape B x k) against the shared x (k,). Returns E, A, alpha and an `ok`
    mask (False where the best alpha is on the grid's edge or the curve is not decreasing)."""
    E, A, alpha = _profile(x, Y)
    edge = (alpha <= ALPHA_GRID[1]) | (alpha >= ALPHA_GRID[-2])
    return E, A, alpha, (A > 0) & ~edge & np.isfinite(E)


def _profile(x: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x0 = np.exp(np.log(x).mean())  # work in x/x0 so A stays O(loss) whatever the units of x
    u = np.log(ALPHA_GRID)
    sse = _sse(x / x0, Y, ALPHA_GRID)  # (B, G)
    i = np.clip(sse.argmin(axis=1), 1, len(u) - 2)
    rows = np.arange(len(Y))
    # one parabolic step in log alpha through the grid minimum and its neighbours
    f0, f1, f2 = sse[rows, i - 1], sse[rows, i], sse[rows, i + 1]
    h = u[1] - u[0]
    denom = f0 - 2 * f1 + f2
    shift = np.where(denom > 0, 0.5 * h * (f0 - f2) / np.where(denom > 0, denom, 1.0), 0.0)
    alpha = np.exp(u[i] + np.clip(shift, -h, h))
    E, A_scaled = _linear_part(x / x0, Y, alpha)
    return E, A_scaled * np.power(x0, alpha), alpha


def _sse(xs: np.ndarray, Y: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    Z = np.power(xs[None, :], -alphas[:, None])  # (G, k)
    Zc = Z - Z.mean(axis=1, keepdims=True)
    Yc = Y - Y.mean(axis=1, keepdims=True)
    szz = np.einsum("gk,gk->g", Zc, Zc)
    szy = Yc @ Zc.T  # (B, G)
    syy = np.einsum("bk,bk->b", Yc, Yc)
    return syy[:, None] - szy**2 / szz[None, :]


def _linear_part(xs: np.ndarray, Y: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares (E, A) of each row of Y given its own alpha."""
    Z = np.power(xs[None, :], -alpha[:, None])  # (B, k)
    Zm, Ym = Z.mean(axis=1, keepdims=True), Y.mean(axis=1, keepdims=True)
    A = ((Z - Zm) * (Y - Ym)).sum(axis=1) / ((Z - Zm) ** 2).sum(axis=1)
    return Ym[:, 0] - A * Zm[:, 0], A


def inverse_batch(E: np.ndarray, A: np.ndarray, alpha: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """x where each fitted law reaches its loss; +inf where the loss is at or below E."""
    gap = loss - E
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x = np.power(A / np.where(gap > 0, gap, np.nan), 1.0 / alpha)
    return np.where(gap > 0, x, np.inf)


# ---------------------------------------------------------------------------------------------
# Chinchilla approach 3

HUBER_DELTA = 1e-3
LOSS_SPACES = ("log", "linear")
# the optimiser's coordinates: a = ln A, b = ln B, e = ln E
RAW_NAMES = ("a", "b", "e", "alpha", "beta")
# Named start grids. "default" (36 starts) reaches the same optimum as Hoffmann et al.'s 4500-start
# grid on the Chinchilla points and as Li et al.'s 1600 starts on the (Mis)Fitting table
# (tests/test_analysis_fits.py); "hoffmann" is the grid of Hoffmann et al. (2022), appendix D.2.
START_GRIDS = {
    "default": "a=0,10,20; b=0,10,20; e=0; alpha=0.3,1; beta=0.3,1",
    "hoffmann": "a=0,5,10,15,20,25; b=0,5,10,15,20,25; e=-1,-0.5,0,0.5,1; alpha=0,0.5,1,1.5,2; beta=0,0.5,1,1.5,2",
}
# a converged start whose objective is within this relative distance of the best "reached the optimum"
OPTIMUM_RTOL = 1e-6
# a term below this share of the fitted loss at every point is invisible to the data
TERM_FLOOR = 1e-3


class BadSetting(ValueError):
    """An option of the fit is invalid; the message names it."""


def parse_start_grid(spec: str) -> tuple[tuple[float, ...], ...]:
    """A named grid or "a=v,v,...; b=...; e=...; alpha=...; beta=..." -> every combination."""
    text = START_GRIDS.get(spec, spec)
    values: dict[str, tuple[float, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, rest = (s.strip() for s in part.partition("="))
        if not sep or name not in RAW_NAMES:
            raise BadSetting(f"start grid {spec!r}: expected one of {', '.join(START_GRIDS)} or "
                             f"'{'=v,v; '.join(RAW_NAMES)}=v,v' (a, b, e are ln A, ln B, ln E)")
        try:
            values[name] = tuple(float(v) for v in rest.split(","))
        except ValueError:
            raise BadSetting(f"start grid {spec!r}: {name}: {rest!r} is not a list of numbers") from None
        if not all(np.isfinite(values[name])):
            raise BadSetting(f"start grid {spec!r}: {name}: values must be finite")
    missing = [n for n in RAW_NAMES if n not in values]
    if missing:
        raise BadSetting(f"start grid {spec!r}: no values for {', '.join(missing)}")
    return tuple(itertools.product(*(values[n] for n in RAW_NAMES)))


@dataclass(frozen=True)
class FitSettings:
    """How the fit is done; the defaults are Hoffmann et al.'s objective and the tolerances that
    reach the published optima (scipy's default L-BFGS-B tolerances stop short on flat objectives)."""

    delta: float = HUBER_DELTA
    loss_space: str = "log"  # Huber loss of log L - log prediction ("log") or L - prediction ("linear")
    start_grid: str = "default"
    ftol: float = 1e-15
    gtol: float = 1e-12
    maxiter: int = 10000

    def __post_init__(self) -> None:
        for name in ("delta", "ftol", "gtol", "maxiter"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise BadSetting(f"{name}: must be positive, got {value}")
        if self.loss_space not in LOSS_SPACES:
            raise BadSetting(f"loss space {self.loss_space!r}: expected one of {', '.join(LOSS_SPACES)}")
        parse_start_grid(self.start_grid)

    @property
    def starts(self) -> tuple[tuple[float, ...], ...]:
        return parse_start_grid(self.start_grid)

    def as_dict(self) -> dict:
        grid = START_GRIDS.get(self.start_grid, self.start_grid)
        return {"huber_delta": self.delta, "loss_space": self.loss_space, "start_grid": self.start_grid,
                "start_grid_values": grid, "starts": len(self.starts), "ftol": self.ftol, "gtol": self.gtol,
                "maxiter": self.maxiter}


@dataclass(frozen=True)
class ChinchillaFit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float  # summed Huber loss at the optimum
    n_points: int

    def __call__(self, N: np.ndarray, D: np.ndarray) -> np.ndarray:
        return self.E + self.A / np.power(N, self.alpha) + self.B / np.power(D, self.beta)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Diagnostics:
    """What the optimiser did and what the optimum can be trusted for."""

    converged: bool  # L-BFGS-B reported convergence for the chosen start
    message: str  # its termination message
    starts: int
    starts_converged: int
    starts_at_optimum: int  # converged starts within OPTIMUM_RTOL of the chosen objective
    inside_delta: int  # points whose residual lies within the Huber delta; the others are fitted ~L1
    excess: float  # objective rise that bounds the likelihood region (see `_halfwidths`)
    halfwidths: dict[str, float]  # how far each parameter moves inside that region (ln for A, B, E)
    flags: tuple[str, ...]  # why the optimum does not determine the parameters; empty when it does

    @property
    def identifiable(self) -> bool:
        return not self.flags

    @property
    def statement(self) -> str:
        return "not identifiable from these points: " + "; ".join(self.flags) + "." if self.flags else ""

    def as_dict(self) -> dict:
        return {**asdict(self), "flags": list(self.flags), "identifiable": self.identifiable,
                "statement": self.statement}


@dataclass(frozen=True)
class ChinchillaResult:
    fit: ChinchillaFit
    diagnostics: Diagnostics
    settings: FitSettings
    x: tuple[float, ...]  # the optimum in the optimiser's coordinates (finite even where E underflows to 0)


def _residuals(p: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, log_space: bool):
    """Residuals of the prediction, and d residual / d each term (a - alpha log N, b - beta log D, e)."""
    a, b, e, alpha, beta = p
    terms = np.stack([a - alpha * logN, b - beta * logD, np.full_like(logN, e)])
    top = terms.max(axis=0)
    lse = top + np.log(np.exp(terms - top).sum(axis=0))  # plain numpy: scipy's logsumexp costs 4x more here
    share = np.exp(terms - lse)  # d lse / d term: each term's share of the predicted loss
    if log_space:
        return lse - logL, share
    pred = np.exp(np.minimum(lse, 700.0))  # a far start must not overflow; the objective is huge there anyway
    return pred - np.exp(logL), share * pred


def _huber_objective(p, logN, logD, logL, delta: float, log_space: bool):
    r, dterm = _residuals(p, logN, logD, logL, log_space)
    size = np.abs(r)
    inner = np.minimum(size, delta)
    value = (0.5 * inner * inner + delta * (size - inner)).sum()  # Huber, in a form that never squares a big r
    w = np.clip(r, -delta, delta) * dterm
    grad = np.array([w[0].sum(), w[1].sum(), w[2].sum(), -(w[0] * logN).sum(), -(w[1] * logD).sum()])
    return value, grad


def _minimize(start, logs, settings: FitSettings):
    return minimize(
        _huber_objective,
        np.asarray(start, float),
        args=(*logs, settings.delta, settings.loss_space == "log"),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": settings.maxiter, "ftol": settings.ftol, "gtol": settings.gtol},
    )


@dataclass(frozen=True)
class _Search:
    best: object  # scipy OptimizeResult of the chosen start
    starts: int
    converged: int
    at_optimum: int


def _search(logs, starts, settings: FitSettings) -> _Search:
    """Every start; the lowest objective among the converged ones wins (among all when none converged,
    which the diagnostics then flag)."""
    with _one_blas_thread():
        runs = [_minimize(s, logs, settings) for s in starts]
    converged = [r for r in runs if r.success]
    best = min(converged or runs, key=lambda r: r.fun)
    at_optimum = sum(bool(r.fun <= best.fun + OPTIMUM_RTOL * abs(best.fun)) for r in converged)
    return _Search(best, len(runs), len(converged), at_optimum)


@contextmanager
def _one_blas_thread():
    """scipy's L-BFGS-B calls BLAS on vectors of 5 thousands of times per start; OpenBLAS wakes its
    thread pool for each call, which on a busy machine made a 36-start fit take 20 s instead of 1 s.
    Best effort: an OpenBLAS loaded in this process is set to one thread and restored after."""
    libs = _loaded_openblas()
    saved = [get() for get, _ in libs]
    for _, set_threads in libs:
        set_threads(1)
    try:
        yield
    finally:
        for (_, set_threads), n in zip(libs, saved):
            set_threads(n)


@functools.cache
def _loaded_openblas() -> list:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and line.rstrip().endswith(".so")}
    except OSError:  # not Linux: leave threading alone
        return []
    found = []
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        for prefix in ("scipy_openblas", "openblas"):  # scipy's wheels prefix their bundled OpenBLAS
            get, put = (getattr(lib, f"{prefix}_{verb}_num_threads", None) for verb in ("get", "set"))
            if get is not None and put is not None:
                get.restype = ctypes.c_int
                found.append((get, put))
                break
    return found


def fit_chinchilla(
    N: np.ndarray, D: np.ndarray, L: np.ndarray, settings: FitSettings = FitSettings()
) -> ChinchillaResult:
    N, D, L = (np.asarray(v, float) for v in (N, D, L))
    if len(L) < 5:
        raise NotIdentifiable(f"{len(L)} point(s); L(N, D) has 5 parameters")
    if np.any(N <= 0) or np.any(D <= 0) or np.any(L <= 0):
        raise NotIdentifiable("params, tokens and loss must be positive")
    logs = np.log(N), np.log(D), np.log(L)
    search = _search(logs, settings.starts, settings)
    fit = _chinchilla_from_raw(search.best.x, search.best.fun, len(L))
    return ChinchillaResult(fit, _diagnose(search, logs, settings), settings, tuple(map(float, search.best.x)))


def _chinchilla_from_raw(x: np.ndarray, fun: float, n: int) -> ChinchillaFit:
    a, b, e, alpha, beta = x
    with np.errstate(over="ignore"):  # a term the data never see may run its coefficient off to inf: flagged
        coefficients = np.exp([e, a, b])
    return ChinchillaFit(*map(float, coefficients), float(alpha), float(beta), float(fun), n)


# ---------------------------------------------------------------------------------------------
# what the optimum determines

HALFWIDTH_NAMES = ("ln_A", "ln_B", "ln_E", "alpha", "beta")


def _diagnose(search: _Search, logs, settings: FitSettings) -> Diagnostics:
    best, n = search.best, len(logs[2])
    r, _ = _residuals(best.x, *logs, settings.loss_space == "log")
    excess, widths = _halfwidths(best.x, best.fun, logs, settings)
    flags = [] if best.success else [f"no start converged (L-BFGS-B: {best.message})"]
    bound = _bound_flags(best.x, logs)
    flags += [text for _, text in bound]
    if n <= 5:
        flags.append(f"{n} points for 5 parameters leave no residual to judge the fit by")
    else:
        flags += _flat_flags(best.x, widths, excess, {name for name, _ in bound})
    return Diagnostics(
        bool(best.success), str(best.message), search.starts, search.converged, search.at_optimum,
        int((np.abs(r) <= settings.delta).sum()), excess, dict(zip(HALFWIDTH_NAMES, map(float, widths))), tuple(flags),
    )


def _bound_flags(x: np.ndarray, logs) -> list[tuple[str, str]]:
    """(parameter, reason) for each parameter the optimum pushed onto a bound: E ~ 0, an exponent
    <= 0, or a term so small the data never see it. Cheap: the bootstrap uses it to drop collapsed refits."""
    a, b, e, alpha, beta = x
    logN, logD, logL = logs
    out = []
    if e < np.log(E_FLOOR) + logL.min():
        floor = f"below {E_FLOOR:.0%} of the lowest loss"
        out.append(("ln_E", f"E = {np.exp(e):.3g} has collapsed onto its bound 0 ({floor})"))
    for name, value, axis in (("alpha", alpha, "N"), ("beta", beta, "D")):
        if value <= 0:
            out.append((name, f"{name} = {value:.3g} is at its bound 0 (the loss does not fall with {axis})"))
    _, share = _residuals(x, *logs, True)
    for i, term in ((0, "A/N^alpha"), (1, "B/D^beta")):
        if share[i].max() < TERM_FLOOR:
            out.append((HALFWIDTH_NAMES[i], f"the {term} term is below {TERM_FLOOR:.1%} of the fitted loss at every "
                                            "point, so its coefficient and exponent are not determined"))
    return out


def _halfwidths(x: np.ndarray, fun: float, logs, settings: FitSettings) -> tuple[float, np.ndarray]:
    """How far each of (ln A, ln B, ln E, alpha, beta) can move, the others re-optimised, before the
    objective rises by `excess` = 2 * objective / (points - 5). Reading the Huber loss as a negative
    log-likelihood whose scale is estimated from the fit (between Laplace and Gaussian), that rise is
    roughly a 95% profile bound. Quadratic approximation with the Gauss-Newton Hessian in these
    log-parameter coordinates, residuals weighted as in IRLS (1 inside delta, delta/|r| outside), which
    smooths the kinks of the L1 part that a finite-difference Hessian would trip on. A direction the
    data do not see at all (eigenvalue ~0) gives a huge width to the parameters it moves."""
    logN, logD, logL = logs
    r, dterm = _residuals(x, logN, logD, logL, settings.loss_space == "log")
    J = np.stack([dterm[0], dterm[1], dterm[2], -dterm[0] * logN, -dterm[1] * logD], axis=1)
    weight = settings.delta / np.maximum(np.abs(r), settings.delta)  # 1 inside delta, delta/|r| outside
    eigval, V = np.linalg.eigh(J.T @ (weight[:, None] * J))
    excess = 2 * fun / max(len(logL) - 5, 1)
    # a floor, not a pseudo-inverse: an unseen direction must widen the parameters it moves, and only those
    floor = 1e-12 * max(eigval.max(), np.finfo(float).tiny)
    inv_diag = (V**2 / np.maximum(eigval, floor)).sum(axis=1)
    return float(excess), np.sqrt(2 * excess * inv_diag)


def _flat_flags(x: np.ndarray, widths: np.ndarray, excess: float, already: set[str]) -> list[str]:
    """A coefficient free to move by FLAT_FACTOR either way, or an exponent free to reach 0, inside the
    likelihood region: the optimum is flat in that direction."""
    out = []
    values = dict(zip(HALFWIDTH_NAMES, x))
    for name, width in zip(HALFWIDTH_NAMES, widths):
        if name in already:
            continue
        if name.startswith("ln_") and width > np.log(FLAT_FACTOR):
            out.append(f"the objective is flat along {name} (±{width:.3g} within an objective rise of {excess:.2g}, "
                       f"{name[3:]} free by more than {FLAT_FACTOR:g}x)")
        elif not name.startswith("ln_") and width >= abs(values[name]):
            out.append(f"the objective is flat along {name} ({values[name]:.3g} ± {width:.3g} within an objective "
                       f"rise of {excess:.2g} reaches 0)")
    return out


# ---------------------------------------------------------------------------------------------
# bootstrap


@dataclass(frozen=True)
class Bootstrap:
    fits: list[ChinchillaFit]  # the refits the intervals rest on
    resamples: int
    failed: int  # no start converged: dropped
    collapsed: int  # converged onto a bound (`_bound_flags`): dropped
    starts: int  # starts per resample


def bootstrap_chinchilla(
    N: np.ndarray, D: np.ndarray, L: np.ndarray, result: ChinchillaResult, resamples: int, seed: int
) -> Bootstrap:
    """Refits on points resampled with replacement. Each resample is searched like the full fit: from the
    whole start grid (plus the full-data optimum, a cheap extra start), best converged start kept. A
    resample with no converged start, or whose refit collapsed onto a bound, is dropped and counted:
    keeping it is how an interval on E would reach down to 0."""
    settings = result.settings
    starts = (*settings.starts, result.x)
    rng = np.random.default_rng(seed)
    logs = np.log(np.asarray(N, float)), np.log(np.asarray(D, float)), np.log(np.asarray(L, float))
    kept, failed, collapsed = [], 0, 0
    for _ in range(resamples):
        idx = rng.integers(0, len(L), size=len(L))
        sample = tuple(v[idx] for v in logs)
        best = _search(sample, starts, settings).best
        if not best.success:
            failed += 1
        elif _bound_flags(best.x, sample):
            collapsed += 1
        else:
            kept.append(_chinchilla_from_raw(best.x, best.fun, len(L)))
    return Bootstrap(kept, resamples, failed, collapsed, len(starts))
