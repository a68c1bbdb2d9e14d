"""Goodness-of-fit helpers for the distribution tests (no scipy needed)."""

from __future__ import annotations

import torch


def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def chi2_gof(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's goodness-of-fit test of ``counts`` [C] against ``probs`` [C].

    Cells expected to hold fewer than ``min_expected`` observations are pooled into one; an observation in
    a cell of probability zero gives p-value 0.
    """
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    n = counts.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    exp = probs * n
    big = exp >= min_expected
    obs_c = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_c = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def chi2_homogeneity(a: torch.Tensor, b: torch.Tensor, min_count: float = 5.0) -> float:
    """p-value of the chi-square test that two count vectors [C] come from the same distribution.

    Cells with fewer than ``min_count`` pooled observations are merged into one.
    """
    a, b = a.double().flatten(), b.double().flatten()
    tot = a + b
    big = tot >= min_count
    a = torch.cat([a[big], a[~big].sum()[None]])
    b = torch.cat([b[big], b[~big].sum()[None]])
    tot = a + b
    keep = tot > 0
    a, b, tot = a[keep], b[keep], tot[keep]
    na, nb = a.sum(), b.sum()
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return 0.5 * float((a / a.sum() - b / b.sum()).abs().sum())
