"""Quantiles and tails of Student's t and of the standard normal (scipy.stats, imported when asked)."""

from __future__ import annotations

from normswap.stats.levels import LEVEL


def t_quantile(q: float, df: int) -> float:
    """The ``q``-quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(q, df))


def two_sided_t_quantile(df: int, level: float = LEVEL) -> float:
    """The t multiplier of a two-sided ``level`` interval: t(0.5 + level/2, df) (0.975 at 95 %)."""
    return t_quantile(0.5 + level / 2, df)


def t_upper_tail(x: float, df: int) -> float:
    """P(T > x) for Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.sf(x, df))


def normal_quantile(q: float) -> float:
    """The ``q``-quantile of the standard normal."""
    from scipy.stats import norm

    return float(norm.ppf(q))


def normal_cdf(x: float) -> float:
    """P(Z ≤ x) for the standard normal."""
    from scipy.stats import norm

    return float(norm.cdf(x))
