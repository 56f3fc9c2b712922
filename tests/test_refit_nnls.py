"""The refit's non-negative least squares (``partitioner.calibration.refit._nnls``, on scipy) against the
definition it replaces: of every set of free unknowns whose columns the rows can tell apart, the
non-negative unconstrained solution with the smallest squared error (all zeros without one)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from partitioner.calibration.refit import _bounded_nnls, _nnls


def _brute_force(rows) -> np.ndarray:
    m = np.asarray(rows, dtype=np.float64)
    a, t = m[:, :-1], m[:, -1]
    n = a.shape[1]
    best, best_err = np.zeros(n), float(t @ t)
    for k in range(n, 0, -1):
        for free in itertools.combinations(range(n), k):
            sub = a[:, list(free)]
            gram = sub.T @ sub
            scale = float(np.prod(np.diagonal(gram)))
            if scale <= 0 or float(np.linalg.det(gram)) <= 1e-6 * scale:
                continue  # columns the rows cannot tell apart
            sol = np.linalg.solve(gram, sub.T @ t)
            if (sol < 0).any():
                continue
            x = np.zeros(n)
            x[list(free)] = sol
            err = float(((a @ x - t) ** 2).sum())
            if err < best_err - 1e-15:
                best, best_err = x, err
    return best


def _problem(rng: np.random.Generator, kind: str) -> list[tuple[float, ...]]:
    rows_n, n = int(rng.integers(3, 9)), int(rng.integers(1, 4))
    a = rng.uniform(0.0, 2.0, size=(rows_n, n))
    coef = rng.normal(0.5, 1.0, size=n)  # some negative: the bounds bind
    noise = 0.05
    if kind == "collinear" and n >= 2:
        # one micro-batch size: a column nearly a multiple of another; targets they fit exactly
        # with positive unknowns, so only the separability rule keeps the pair out
        a[:, 1] = a[:, 0] * rng.uniform(0.5, 3.0) * (1 + 1e-4 * rng.standard_normal(rows_n))
        coef, noise = np.abs(coef), 0.0
    if kind == "unexercised" and n >= 2:
        a[:, -1] = 0.0
    t = a @ coef + noise * rng.standard_normal(rows_n)
    return [tuple(row) + (target,) for row, target in zip(a, t)]


@pytest.mark.parametrize("kind", ["plain", "collinear", "unexercised"])
def test_nnls_matches_the_brute_force_on_random_small_problems(kind):
    rng = np.random.default_rng({"plain": 0, "collinear": 1, "unexercised": 2}[kind])
    bound = 0
    for _ in range(60):
        rows = _problem(rng, kind)
        expected = _brute_force(rows)
        got = np.array(_nnls(rows))
        assert got.shape == expected.shape and (got >= 0).all()
        np.testing.assert_allclose(got, expected, rtol=1e-7, atol=1e-9, err_msg=str(rows))
        m = np.asarray(rows)
        unconstrained = np.linalg.lstsq(m[:, :-1], m[:, -1], rcond=None)[0]
        bound += bool((unconstrained < 0).any())
    if kind != "collinear":
        assert bound >= 10  # the problems exercise the non-negativity, not only the plain solve


def test_collinear_columns_keep_one_unknown():
    # two columns in a fixed ratio (the rows cannot tell them apart): one unknown carries the fit
    rows = [(x, 2 * x, 3 * x) for x in (1.0, 2.0, 3.0)]
    x0, x1 = _nnls(rows)
    assert (x0, x1) == pytest.approx((3.0, 0.0))


def test_no_non_negative_fit_is_all_zeros():
    assert _nnls([(1.0, 1.0, -1.0), (2.0, 1.0, -2.0)]) == (0.0, 0.0)


def test_an_unbounded_unknown_is_fitted_beside_held_ones():
    # the refit's rows: FLOP part, memory-bound part, operators, target; both rates held at 1,
    # the per-op overhead in [0, inf) fitted (an infinite upper bound is no pinned value)
    truth = 3e-5
    rows = [(0.05, 0.01, ops, 0.05 + 0.01 + ops * truth) for ops in (28_000.0, 20_000.0, 12_000.0)]
    x, y, o = _bounded_nnls(rows, ((1.0, 1.0), (1.0, 1.0), (0.0, float("inf"))))
    assert (x, y) == (1.0, 1.0) and o == pytest.approx(truth, rel=1e-9)
    # the peak free within (0.5, 2): this noise-free data tells it, and it is found
    rows = [(f, 0.01, ops, 2.0 * f + 0.01 + ops * truth) for f, ops in ((0.05, 28_000.0), (0.3, 20_000.0), (0.6, 12_000.0))]
    x, _, o = _bounded_nnls(rows, ((0.5, 2.0), (1.0, 1.0), (0.0, float("inf"))))
    assert x == pytest.approx(2.0, rel=1e-9) and o == pytest.approx(truth, rel=1e-9)
