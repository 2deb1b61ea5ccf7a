"""Student's t quantile without scipy: printed table values, symmetry, and scipy's ``stdtrit`` where installed."""

import math

import pytest

from sdcscope.study.stats import _t_quantile

TABLE = [  # (q, dof, t): standard two-decimal-plus tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2)
    (0.95, 1, 6.314),
    (0.975, 1, 12.706),
    (0.99, 1, 31.821),
    (0.95, 2, 2.920),
    (0.99, 2, 6.965),
    (0.95, 3, 2.353),
    (0.99, 4, 3.747),
    (0.975, 10, 2.228),
    (0.995, 10, 3.169),
    (0.99, 19, 2.539),
    (0.95, 30, 1.697),
    (0.999, 30, 3.385),
    (0.975, 100, 1.984),
]


@pytest.mark.parametrize("q, dof, t", TABLE)
def test_matches_printed_tables(q, dof, t):
    assert round(_t_quantile(q, dof), 3) == t


def test_is_odd_and_zero_at_the_median():
    for dof in (1, 2, 3, 7, 50):
        assert _t_quantile(0.5, dof) == 0.0
        for q in (0.6, 0.9, 0.999, 0.9999999):  # 1 - q is exact for q >= 0.5
            assert _t_quantile(1 - q, dof) == pytest.approx(-_t_quantile(q, dof), rel=1e-12)


def test_matches_scipy_to_a_few_ulps():
    special = pytest.importorskip("scipy.special")
    for dof in (1, 2, 3, 4, 5, 9, 24, 100, 1000):
        for q in (1e-9, 1e-4, 0.01, 0.3, 0.6, 0.7, 0.8, 0.9, 0.95, 0.975, 0.99, 0.995, 0.9999):
            want = float(special.stdtrit(dof, q))
            assert math.isclose(_t_quantile(q, dof), want, rel_tol=1e-11), (q, dof)


@pytest.mark.parametrize("q, dof", [(0.0, 3), (1.0, 3), (0.5, 0), (0.5, 2.5), (0.5, True)])
def test_refuses_what_has_no_quantile(q, dof):
    with pytest.raises(ValueError):
        _t_quantile(q, dof)
