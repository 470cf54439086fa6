"""Statistics for speculative-decoding measurements: acceptance length tau, per-position acceptance,
throughput ratio, and two-one-sided-tests (TOST) equivalence between two runs.

The unit of analysis is the prompt (a whole conversation for multi-turn sets such as MT-bench),
not the verification step: steps within one prompt share the text and the draft's state, so they
are correlated, and treating them as independent would make the intervals far too narrow.

Choices (so results can be reproduced by hand):

* tau = sum of tokens emitted over all steps / number of steps (every prompt, every turn). This is
  the number serving engines report (each verification step counts once; the bonus token is
  included). It is a ratio estimator R = sum_j y_j / sum_j x_j over prompts j (y_j = tokens emitted
  in prompt j, x_j = steps in prompt j). Its standard error is the linearised (delta-method,
  cluster-robust) one:  se^2 = n/(n-1) * sum_j (y_j - R x_j)^2 / (sum_j x_j)^2,  and the interval is
  R +- t_{1-a/2, n-1} * se (the CLI clips it to the possible range [1, K+1]). This weighs prompts by their step count, unlike a t-interval over
  per-prompt means (which answers a different question: the tau of a typical prompt).
* Per-position acceptance: unconditional rate_i = sum_j acc_ij / sum_j steps_j (the share of steps
  whose draft token i was accepted), conditional rate_i = sum_j acc_ij / sum_j acc_(i-1)j (given
  that token i-1 was accepted; for i = 0 the same as unconditional). Both are ratio estimators with
  the interval above, clipped to [0, 1].
* Throughput ratio (speedup) = mean(a) / mean(b) of per-prompt tokens/s of two arms, with the
  two-sample delta-method variance  R^2 (s_a^2/(n_a m_a^2) + s_b^2/(n_b m_b^2))  and a Welch-
  Satterthwaite number of degrees of freedom (as in the Nemotron 3.5 Lightning EAGLE-3 card's
  "two-sample delta-method intervals"). Ignoring the pairing of prompts makes it conservative;
  `paired=True` gives the paired linearisation instead.
* TOST: H0_low: d <= -margin and H0_high: d >= +margin for d = est_a - est_b, each tested with a
  one-sided Welch-type t (se^2 = se_a^2 + se_b^2, Welch-Satterthwaite df). Equivalence is declared
  when both one-sided p-values are below alpha, i.e. when the (1 - 2 alpha) interval of d lies
  inside (-margin, +margin). `equivalence_margins` gives the smallest margin an observed difference
  supports, |d| + t_{1-alpha} se, and the floor t_{1-alpha} se no difference could get below at that
  sample size. For task accuracy (a share of problems passed) `tost_proportions` uses the unpooled
  binomial se^2 = p_a(1-p_a)/n_a + p_b(1-p_b)/n_b and the normal distribution.

The t distribution is implemented here (regularised incomplete beta by a continued fraction,
quantile by bisection) so nothing beyond numpy is needed.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

import numpy as np

__all__ = [
    "Estimate", "TostResult", "betainc", "t_cdf", "t_sf", "t_ppf", "normal_cdf", "normal_ppf",
    "ratio_estimate", "tau_estimate", "acceptance_rates", "mean_estimate", "ratio_of_means",
    "welch_df", "tost", "tost_from_estimates", "equivalence_margins", "proportion_estimate", "tost_proportions",
]

# ---------------------------------------------------------------------------------------------
# distributions


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for a, b > 0 and 0 <= x <= 1.

    Continued fraction (the classic expansion with terms d_{2m}, d_{2m+1}) evaluated by the modified
    Lentz method; it converges quickly for x < (a+1)/(a+b+2), the other side uses
    I_x(a,b) = 1 - I_{1-x}(b,a)."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc needs a > 0 and b > 0, got a={a}, b={b}")
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - betainc(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    tiny, eps = 1e-300, 1e-15
    f, c, d = 1.0, 1.0, 0.0  # fraction 1 + d1/(1 + d2/(1 + ...))
    for j in range(1, 10000):
        m = j // 2
        if j % 2:  # odd term d_{2m+1}
            coef = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:  # even term d_{2m}
            coef = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + coef * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + coef / c
        c = c if abs(c) > tiny else tiny
        delta = c * d
        f *= delta
        if abs(delta - 1.0) < eps:
            break
    return math.exp(log_front) / (a * f)


def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def t_cdf(x: float, df: float) -> float:
    """P(T <= x) for Student's t with `df` degrees of freedom (df may be non-integer or inf)."""
    if math.isnan(x) or math.isnan(df):
        return math.nan
    if df <= 0:
        raise ValueError(f"the t distribution needs df > 0, got {df}")
    if math.isinf(df):
        return normal_cdf(x)
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + x * x))  # P(T > |x|)
    return 1.0 - tail if x > 0 else tail


def t_sf(x: float, df: float) -> float:
    """P(T > x); computed from the lower tail of -x so small p-values keep their precision."""
    return t_cdf(-x, df)


def _invert(cdf, p: float) -> float:
    """x with cdf(x) = p for a symmetric continuous cdf, by bracketing and bisection."""
    if not 0.0 < p < 1.0:
        if p == 0.0:
            return -math.inf
        if p == 1.0:
            return math.inf
        raise ValueError(f"a probability must be in [0, 1], got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -_invert(cdf, 1.0 - p)
    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, hi * 2.0
        if hi > 1e12:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@functools.lru_cache(maxsize=4096)
def t_ppf(p: float, df: float) -> float:
    """Quantile of Student's t: x with P(T <= x) = p."""
    if df <= 0:
        raise ValueError(f"the t distribution needs df > 0, got {df}")
    return _invert(lambda x: t_cdf(x, df), p)


@functools.lru_cache(maxsize=256)
def normal_ppf(p: float) -> float:
    return _invert(normal_cdf, p)


# ---------------------------------------------------------------------------------------------
# estimates


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its two-sided `level` interval [lo, hi] (nan when n is too small)."""
    value: float
    lo: float
    hi: float
    se: float
    df: float
    n: int
    level: float
    method: str

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        if math.isnan(self.lo):
            return f"{self.value:.3f}"
        return f"{self.value:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


def _as_1d(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence (one value per prompt), got shape {a.shape}")
    if a.size and not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains non-finite values: {a[~np.isfinite(a)][:5].tolist()}")
    return a


def _interval(value: float, se: float, df: float, level: float) -> tuple[float, float]:
    if not (0.0 < level < 1.0):
        raise ValueError(f"the confidence level must be in (0, 1), got {level}")
    if not (math.isfinite(se) and df > 0):
        return math.nan, math.nan
    q = t_ppf(0.5 + level / 2.0, df)
    return value - q * se, value + q * se


def ratio_estimate(y, x, level: float = 0.95, clip: Optional[tuple[float, float]] = None,
                   method: str = "ratio, cluster delta-method, t(n-1)") -> Estimate:
    """sum(y)/sum(x) over clusters (prompts) with the linearised cluster-robust interval (see the
    module docstring). y and x hold one total per cluster."""
    y, x = _as_1d(y, "y"), _as_1d(x, "x")
    if y.shape != x.shape:
        raise ValueError(f"y and x need one value per cluster each, got {y.size} and {x.size}")
    n = int(y.size)
    sx = float(x.sum())
    if n == 0 or sx == 0.0:
        return Estimate(math.nan, math.nan, math.nan, math.nan, math.nan, n, level, method)
    r = float(y.sum()) / sx
    if n < 2:
        return Estimate(r, math.nan, math.nan, math.nan, math.nan, n, level, method)
    resid = y - r * x
    se = math.sqrt(n / (n - 1) * float(np.sum(resid * resid))) / sx
    lo, hi = _interval(r, se, n - 1, level)
    if clip is not None and not math.isnan(lo):
        lo, hi = max(lo, clip[0]), min(hi, clip[1])
    return Estimate(r, lo, hi, se, float(n - 1), n, level, method)


def tau_estimate(accept_lengths: Sequence[Sequence[int]], level: float = 0.95) -> Estimate:
    """tau from per-prompt lists of tokens emitted per verification step (bonus included)."""
    if not len(accept_lengths):
        raise ValueError("tau needs at least one prompt's accept lengths")
    y = [float(np.sum(a)) for a in accept_lengths]
    x = [float(len(a)) for a in accept_lengths]
    return ratio_estimate(y, x, level)


def acceptance_rates(accepted_per_position, steps, level: float = 0.95) -> dict[str, list[Estimate]]:
    """Per-position acceptance from per-prompt counts: `accepted_per_position` [n_prompts, K] (how
    many steps accepted draft token i), `steps` [n_prompts]. Returns {"unconditional": [...K],
    "conditional": [...K]}."""
    acc = np.asarray(accepted_per_position, dtype=np.float64)
    steps = _as_1d(steps, "steps")
    if acc.ndim != 2 or acc.shape[0] != steps.size:
        raise ValueError(f"accepted_per_position must be [n_prompts={steps.size}, K], got shape {acc.shape}")
    uncond, cond = [], []
    for i in range(acc.shape[1]):
        uncond.append(ratio_estimate(acc[:, i], steps, level, clip=(0.0, 1.0)))
        base = steps if i == 0 else acc[:, i - 1]
        cond.append(ratio_estimate(acc[:, i], base, level, clip=(0.0, 1.0)))
    return {"unconditional": uncond, "conditional": cond}


def mean_estimate(samples, level: float = 0.95) -> Estimate:
    """Mean with the usual t interval (df = n - 1)."""
    a = _as_1d(samples, "samples")
    n = int(a.size)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, math.nan, math.nan, 0, level, "mean, t(n-1)")
    m = float(a.mean())
    if n < 2:
        return Estimate(m, math.nan, math.nan, math.nan, math.nan, n, level, "mean, t(n-1)")
    se = float(a.std(ddof=1)) / math.sqrt(n)
    lo, hi = _interval(m, se, n - 1, level)
    return Estimate(m, lo, hi, se, float(n - 1), n, level, "mean, t(n-1)")


def welch_df(se_a: float, df_a: float, se_b: float, df_b: float) -> float:
    """Welch-Satterthwaite degrees of freedom of se_a^2 + se_b^2."""
    va, vb = se_a * se_a, se_b * se_b
    den = (va * va / df_a if va else 0.0) + (vb * vb / df_b if vb else 0.0)
    if den == 0.0:
        return math.inf
    return (va + vb) ** 2 / den


def ratio_of_means(a, b, level: float = 0.95, paired: bool = False) -> Estimate:
    """mean(a) / mean(b) with a delta-method interval: two independent samples (default; Welch-
    Satterthwaite df) or paired samples (linearised per pair, df = n - 1)."""
    a, b = _as_1d(a, "a"), _as_1d(b, "b")
    if a.size == 0 or b.size == 0:
        raise ValueError("a ratio of means needs at least one value in each sample")
    ma, mb = float(a.mean()), float(b.mean())
    if mb == 0.0:
        raise ValueError("the mean of the denominator sample is 0; the ratio is undefined")
    r = ma / mb
    if paired:
        if a.size != b.size:
            raise ValueError(f"paired samples must have equal sizes, got {a.size} and {b.size}")
        # sum(a)/sum(b) == mean(a)/mean(b): the cluster ratio estimator with pairs as clusters
        return ratio_estimate(a, b, level, method="ratio of means, paired delta-method, t(n-1)")
    method = "ratio of means, two-sample delta-method, Welch t"
    if a.size < 2 or b.size < 2:
        return Estimate(r, math.nan, math.nan, math.nan, math.nan, int(min(a.size, b.size)), level, method)
    # relative variance components of each mean; the ratio's se = |r| * sqrt(ca + cb)
    ca = float(a.var(ddof=1)) / (a.size * ma * ma) if ma else math.inf
    cb = float(b.var(ddof=1)) / (b.size * mb * mb)
    se = abs(r) * math.sqrt(ca + cb)
    df = welch_df(math.sqrt(ca), a.size - 1, math.sqrt(cb), b.size - 1)
    lo, hi = _interval(r, se, df, level)
    return Estimate(r, lo, hi, se, df, int(min(a.size, b.size)), level, method)


# ---------------------------------------------------------------------------------------------
# equivalence


@dataclass(frozen=True)
class TostResult:
    estimate_a: float
    estimate_b: float
    diff: float  # estimate_a - estimate_b
    se: float
    df: float
    margin_low: float  # equivalence region (margin_low, margin_high) for diff
    margin_high: float
    p_low: float  # p-value of H0: diff <= margin_low
    p_high: float  # p-value of H0: diff >= margin_high
    p: float  # max(p_low, p_high), the TOST p-value
    alpha: float
    ci_low: float  # the (1 - 2 alpha) interval of diff; inside the margins <=> equivalent
    ci_high: float
    equivalent: bool

    @property
    def verdict(self) -> str:
        if self.equivalent:
            return "equivalent"
        return "not shown equivalent"

    def to_dict(self) -> dict:
        return dict(asdict(self), verdict=self.verdict)

    def __str__(self) -> str:
        return (f"diff {self.diff:+.4f} ({100 * (1 - 2 * self.alpha):.0f}% CI [{self.ci_low:+.4f}, {self.ci_high:+.4f}]) "
                f"within ({self.margin_low:+.4f}, {self.margin_high:+.4f}): p_low={self.p_low:.3g}, "
                f"p_high={self.p_high:.3g} -> {self.verdict}")


def _margins(margin: Union[float, tuple[float, float]]) -> tuple[float, float]:
    if isinstance(margin, (tuple, list)):
        lo, hi = float(margin[0]), float(margin[1])
    else:
        lo, hi = -abs(float(margin)), abs(float(margin))
    if not lo < hi:
        raise ValueError(f"the equivalence margin must give low < high, got ({lo}, {hi}); pass e.g. margin=0.05")
    return lo, hi


def tost_from_estimates(est_a: float, se_a: float, df_a: float, est_b: float, se_b: float, df_b: float,
                        margin: Union[float, tuple[float, float]], alpha: float = 0.05) -> TostResult:
    """TOST for two independent estimates with standard errors and degrees of freedom (Welch-type:
    se^2 = se_a^2 + se_b^2, Welch-Satterthwaite df)."""
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    lo, hi = _margins(margin)
    for name, v in (("se_a", se_a), ("se_b", se_b)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}={v}: each run needs a finite standard error (at least 2 prompts)")
    diff = float(est_a) - float(est_b)
    se = math.sqrt(se_a * se_a + se_b * se_b)
    df = welch_df(se_a, df_a, se_b, df_b)
    if se == 0.0:  # no sampling noise: the difference itself decides
        p_low = 0.0 if diff > lo else 1.0
        p_high = 0.0 if diff < hi else 1.0
        ci = (diff, diff)
    else:
        p_low = t_sf((diff - lo) / se, df)  # reject "diff <= lo" when diff is far above lo
        p_high = t_cdf((diff - hi) / se, df)  # reject "diff >= hi" when diff is far below hi
        q = t_ppf(1.0 - alpha, df)
        ci = (diff - q * se, diff + q * se)
    p = max(p_low, p_high)
    return TostResult(float(est_a), float(est_b), diff, se, df, lo, hi, p_low, p_high, p, alpha,
                      ci[0], ci[1], bool(p < alpha))


def tost(a, b, margin: Union[float, tuple[float, float]], alpha: float = 0.05) -> TostResult:
    """TOST on the difference of the means of two independent samples (Welch)."""
    a, b = _as_1d(a, "a"), _as_1d(b, "b")
    if a.size < 2 or b.size < 2:
        raise ValueError(f"TOST needs at least 2 values per sample, got {a.size} and {b.size}")
    ea, eb = mean_estimate(a), mean_estimate(b)
    return tost_from_estimates(ea.value, ea.se, ea.df, eb.value, eb.se, eb.df, margin, alpha)


# ---------------------------------------------------------------------------------------------
# equivalence: the margin a sample supports, and task accuracy (proportions)


def equivalence_margins(diff: float, se: float, df: float, alpha: float) -> dict:
    """What margins a TOST at `alpha` can declare for an observed difference `diff` with standard
    error `se` and `df` degrees of freedom (symmetric margins +-m):

    * `smallest_margin` = |diff| + t_{1-alpha, df} * se: equivalence is declared for every margin
      above it (there the (1 - 2 alpha) interval of the difference lies inside (-m, +m));
    * `margin_floor` = t_{1-alpha, df} * se: the smallest margin this sample size could support
      however small the true difference (the observed difference 0).

    Both are the half-width arithmetic of the TOST in `tost_from_estimates`; `se` 0 gives |diff|."""
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    if not (math.isfinite(se) and se >= 0):
        raise ValueError(f"se={se}: the margins need a finite, non-negative standard error")
    q = t_ppf(1.0 - alpha, df) if se > 0 else 0.0
    return {"smallest_margin": abs(float(diff)) + q * se, "margin_floor": q * se, "quantile": q, "alpha": alpha}


def proportion_estimate(successes: int, n: int, level: float = 0.95) -> Estimate:
    """A proportion successes / n with the normal (Wald) interval, se = sqrt(p (1 - p) / n)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"a proportion needs 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p = successes / n
    se = math.sqrt(p * (1.0 - p) / n)
    lo, hi = _interval(p, se, math.inf, level) if se > 0 else (p, p)
    return Estimate(p, max(lo, 0.0), min(hi, 1.0), se, math.inf, int(n), level, "proportion, normal (Wald)")


def tost_proportions(successes_a: int, n_a: int, successes_b: int, n_b: int,
                     margin: Union[float, tuple[float, float]], alpha: float = 0.05) -> TostResult:
    """TOST on the difference of two proportions p_a - p_b (e.g. pass@1 of two arms, the problem
    as the unit), with the unpooled binomial standard error se^2 = p_a(1-p_a)/n_a + p_b(1-p_b)/n_b
    and the normal distribution (df = inf). The arms are treated as independent samples even when
    they answered the same problems: with outcomes positively correlated between arms that makes
    the test conservative. ValueError when neither arm varies (all pass or all fail in both): the
    sample then gives no standard error, and no equivalence can be shown from it."""
    ea = proportion_estimate(successes_a, n_a)
    eb = proportion_estimate(successes_b, n_b)
    if ea.se == 0.0 and eb.se == 0.0:
        raise ValueError(f"no variation in either arm ({successes_a}/{n_a} and {successes_b}/{n_b}): the "
                         "standard error is 0 and equivalence cannot be tested; use more problems or a task "
                         "the model neither always passes nor always fails")
    return tost_from_estimates(ea.value, ea.se, math.inf, eb.value, eb.se, math.inf, margin, alpha)
