"""The verdict rule of the study: intervals, the minimum detectable difference, and three verdicts.

A claim predicts the sign of a difference (STEM's loss minus dense's is negative, a slope is
positive, ...). From the measured values of each seed:

* ``difference(a, b)``: the mean of ``a - b`` with its standard error and Student-t degrees of
  freedom, *paired* by seed when both sides have the same seeds (every seed fixes the model init
  and the data order of both runs, so pairing removes the data-order part of the noise), else
  Welch's unpaired form;
* the 95 % interval ``mean ± t(0.975, df) · se``;
* the minimum detectable difference at 80 % power and 5 % two-sided level,
  ``MDE = (t(0.975, df) + t(0.80, df)) · se``: smaller true effects are likely to come out
  inconclusive;
* ``verdict``: **holds** when the interval lies wholly on the side the claim predicts,
  **contradicted** when it lies wholly on the other side, **inconclusive** otherwise (and always
  with fewer than two values per side: no noise estimate). A *single seed is never a noise
  estimate*: values that share one seed (validation batches, probe items of one model) are not
  replicates of the seed-to-seed noise, and ``one_seed`` refuses to treat them as such.
* ``holm``: a claim made of several comparisons (placements, arms) is judged with Holm's step-down
  correction over them: sorted by p-value, the i-th (from 0) of m is judged by its interval at level
  ``1 − 0.05 / (m − i)``; after the first comparison that is not significant at its level, the rest
  are inconclusive. The corrected interval is printed with each comparison.

Also here: an exact two-sided binomial (sign) test for counts, and a least-squares line with the
interval of its slope (the trend of a gap over training).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

LEVEL, POWER = 0.95, 0.80
VERDICTS = ("holds", "contradicted", "inconclusive")
ALPHA = 1 - LEVEL
RULE = ("holds if the 95 % interval of the difference lies wholly on the side the claim predicts, contradicted if "
        "wholly on the other side, else inconclusive; MDE = (t₀.₉₇₅ + t₀.₈₀)·se, the smallest true difference "
        "found with 80 % power; one seed is always inconclusive; the comparisons a claim combines (placements, arms) are "
        "Holm-corrected: the i-th smallest p of m is judged by its interval at 1 − 0.05/(m − i), and after the first "
        "that is not significant the rest are inconclusive")


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom (``df = inf``: the normal)."""
    if math.isinf(df):
        return 0.5 * (1.0 + math.erf(t / math.sqrt(2.0)))
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on ``t_cdf``)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2.0


def mde(se: float, df: float, level: float = LEVEL, power: float = POWER) -> float:
    """Minimum detectable difference: ``(t((1 + level) / 2, df) + t(power, df)) · se``."""
    return (t_quantile((1.0 + level) / 2.0, df) + t_quantile(power, df)) * se


@dataclass
class Difference:
    """``a - b`` as measured: mean, standard error, degrees of freedom, 95 % interval and MDE
    (``se``, ``ci`` and ``mde`` are None without a noise estimate)."""

    mean: float
    se: float | None
    df: float | None
    n: int
    kind: str  # "paired" (by seed), "welch", or "single" (no noise estimate)
    ci: tuple[float, float] | None
    mde: float | None

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self, unit: str = "", fmt: str = "+.3f") -> str:
        """``+0.123 [+0.050, +0.196], MDE 0.090 (n=3 paired)``."""
        if self.ci is None:
            return f"{self.mean:{fmt}}{unit} (n={self.n}, no noise estimate)"
        return (f"{self.mean:{fmt}}{unit} [{self.ci[0]:{fmt}}, {self.ci[1]:{fmt}}], MDE {self.mde:.3g} "
                f"(n={self.n} {self.kind})")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _var(xs: list[float]) -> float:
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def from_se(mean: float, se: float | None, df: float | None, n: int, kind: str) -> Difference:
    """A ``Difference`` from a mean, its standard error and degrees of freedom."""
    if se is None or df is None or df <= 0:
        return Difference(mean, None, None, n, "single", None, None)
    half = t_quantile((1.0 + LEVEL) / 2.0, df) * se
    return Difference(mean, se, df, n, kind, (mean - half, mean + half), mde(se, df))


def one_sample(xs: list[float], kind: str = "paired") -> Difference:
    """Mean of ``xs`` with its t interval (``xs``: per-seed differences, slopes, ...)."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        raise ValueError("no values to compare")
    if len(xs) < 2:
        return from_se(xs[0], None, None, 1, "single")
    return from_se(_mean(xs), math.sqrt(_var(xs) / len(xs)), len(xs) - 1, len(xs), kind)


def difference(a: dict | list, b: dict | list) -> Difference:
    """``mean(a) - mean(b)``: paired by key when ``a`` and ``b`` are ``{seed: value}`` with the same
    keys, else Welch's unpaired form (lists, or dicts with different keys)."""
    if isinstance(a, dict) and isinstance(b, dict) and set(a) == set(b) and len(a) >= 2:
        return one_sample([a[k] - b[k] for k in sorted(a)], "paired")
    xa = [float(x) for x in (a.values() if isinstance(a, dict) else a)]
    xb = [float(x) for x in (b.values() if isinstance(b, dict) else b)]
    if not xa or not xb:
        raise ValueError("no values to compare")
    mean, n = _mean(xa) - _mean(xb), min(len(xa), len(xb))
    if len(xa) < 2 or len(xb) < 2:
        return from_se(mean, None, None, n, "single")
    va, vb = _var(xa) / len(xa), _var(xb) / len(xb)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return from_se(mean, 0.0, len(xa) + len(xb) - 2, n, "welch")
    df = (va + vb) ** 2 / (va ** 2 / (len(xa) - 1) + vb ** 2 / (len(xb) - 1))
    return from_se(mean, se, df, n, "welch")


def interval(d: Difference, level: float = LEVEL) -> tuple[float, float] | None:
    """The ``level`` t interval of ``d`` (None without a noise estimate)."""
    if d.se is None or d.df is None:
        return None
    half = t_quantile((1.0 + level) / 2.0, d.df) * d.se
    return (d.mean - half, d.mean + half)


def p_value(d: Difference) -> float | None:
    """Two-sided t-test p-value of ``d.mean`` against 0 (None without a noise estimate)."""
    if d.se is None or d.df is None:
        return None
    if d.se == 0.0:
        return 0.0 if d.mean != 0 else 1.0
    return min(1.0, 2.0 * (1.0 - t_cdf(abs(d.mean) / d.se, d.df)))


def holm(tests: list[tuple[float | None, str]], alpha: float = ALPHA) -> list[dict]:
    """Holm's step-down correction over ``m`` tests ``[(p, raw_verdict)]``: per test ``{"p", "level", "rank",
    "m", "verdict"}``, where ``level`` is the family-wise interval level the test is judged at and
    ``verdict`` the raw one when significant at it (else ``inconclusive``). A test without a p-value
    counts in ``m`` and is inconclusive."""
    m = len(tests)
    order = sorted(range(m), key=lambda i: (tests[i][0] is None, tests[i][0] if tests[i][0] is not None else 1.0))
    out: list[dict] = [{}] * m
    stopped = False
    for rank, i in enumerate(order):
        p, raw = tests[i]
        a = alpha / (m - rank)
        significant = not stopped and p is not None and p < a and raw in ("holds", "contradicted")
        stopped |= not significant
        out[i] = {"p": p, "level": 1.0 - a, "rank": rank + 1, "m": m, "verdict": raw if significant else "inconclusive"}
    return out


def verdict(d: Difference, sign: int) -> str:
    """``holds`` / ``contradicted`` / ``inconclusive`` for a claim that ``d.mean`` has sign ``sign`` (±1)."""
    if d.ci is None:
        return "inconclusive"
    lo, hi = d.ci
    if (sign > 0 and lo > 0) or (sign < 0 and hi < 0):
        return "holds"
    if (sign > 0 and hi < 0) or (sign < 0 and lo > 0):
        return "contradicted"
    return "inconclusive"


def combine(verdicts: list[str]) -> str:
    """One verdict for a claim made of several comparisons: contradicted if any is, holds if all
    hold, else inconclusive."""
    if not verdicts:
        return "inconclusive"
    if "contradicted" in verdicts:
        return "contradicted"
    return "holds" if all(v == "holds" for v in verdicts) else "inconclusive"


def seeds_needed(d: Difference, cap: int = 100) -> int | None:
    """How many seeds (paired values) would make an effect of ``d.mean`` detectable (MDE ≤ |mean|) at the
    spread measured; None without a spread, ``cap + 1`` when more than ``cap`` would be needed."""
    if d.se is None or d.n < 2 or d.mean == 0:
        return None
    sd = d.se * math.sqrt(d.n)
    for n in range(2, cap + 1):
        if mde(sd / math.sqrt(n), n - 1) <= abs(d.mean):
            return n
    return cap + 1


def sign_test(k: int, n: int) -> float:
    """Exact two-sided binomial p-value of ``k`` of ``n`` events on one side when both sides are equally likely."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(k, n - k) + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def smallest_significant_split(n: int, alpha: float = 1 - LEVEL) -> int | None:
    """The largest ``k`` for which ``k`` of ``n`` events on one side is significant (None: none is)."""
    ks = [k for k in range(0, n // 2 + 1) if sign_test(k, n) < alpha]
    return max(ks) if ks else None


@dataclass
class Line:
    """Least-squares ``y = intercept + slope · x`` with the slope's standard error."""

    slope: float
    intercept: float
    slope_se: float | None
    n: int

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x

    def root(self) -> float | None:
        """Where the line crosses zero (None for a flat line)."""
        return None if self.slope == 0 else -self.intercept / self.slope


def fit_line(xs: list[float], ys: list[float]) -> Line:
    """Ordinary least squares of ``ys`` on ``xs`` (at least two distinct ``xs``)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct x values")
    mx, my = _mean(xs), _mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    se = None
    if n > 2:
        rss = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
        se = math.sqrt(rss / (n - 2) / sxx)
    return Line(slope, intercept, se, n)
