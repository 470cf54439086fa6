"""specjax.eval.stats: tau and its interval, the t distribution, acceptance rates, the throughput
ratio and TOST, each against a hand computation, a closed form, a table value, a simulation or a
bootstrap. Tolerances are stated at each check."""
import math

import numpy as np
import pytest

from specjax.eval import stats as st


# --- t distribution -----------------------------------------------------------------------------

# two-sided 95% (and a few other) quantiles from a printed t table, 6 decimals
T_TABLE = [(0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 5, 2.570582), (0.975, 9, 2.262157),
           (0.975, 30, 2.042272), (0.95, 5, 2.015048), (0.95, 20, 1.724718), (0.995, 20, 2.845340),
           (0.9995, 10, 4.586894), (0.975, math.inf, 1.959964)]


@pytest.mark.parametrize("p,df,q", T_TABLE)
def test_t_ppf_matches_table(p, df, q):
    assert st.t_ppf(p, df) == pytest.approx(q, abs=1e-6)  # table precision
    assert st.t_ppf(1 - p, df) == pytest.approx(-q, abs=1e-6)
    assert st.t_cdf(q, df) == pytest.approx(p, abs=1e-6)


def test_t_cdf_closed_forms():
    # df=1 is the Cauchy distribution; df=2 has cdf 1/2 + x / (2 sqrt(2 + x^2))
    for x in (-40.0, -3.0, -0.5, 0.0, 0.2, 1.0, 7.0):
        assert st.t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-13)
        assert st.t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * math.sqrt(2 + x * x)), abs=1e-13)
    # far tail keeps relative precision (Cauchy: P(T > x) ~ 1/(pi x))
    assert st.t_sf(1e6, 1) == pytest.approx(math.atan(1 / 1e6) / math.pi, rel=1e-9)


def test_betainc_closed_forms():
    for x in (0.01, 0.3, 0.5, 0.77, 0.999):
        assert st.betainc(1, 1, x) == pytest.approx(x, abs=1e-14)
        assert st.betainc(3.5, 1, x) == pytest.approx(x ** 3.5, abs=1e-13)
        assert st.betainc(1, 4.2, x) == pytest.approx(1 - (1 - x) ** 4.2, abs=1e-13)
        assert st.betainc(2.5, 0.7, x) + st.betainc(0.7, 2.5, 1 - x) == pytest.approx(1.0, abs=1e-13)


def test_t_against_scipy_when_present():
    scipy_stats = pytest.importorskip("scipy.stats")  # an independent implementation (jax depends on scipy)
    for df in (0.7, 1, 3, 9.5, 29, 200, 1e5):
        for x in (-12.0, -2.0, -0.3, 0.0, 1.1, 4.0):
            assert st.t_cdf(x, df) == pytest.approx(scipy_stats.t.cdf(x, df), rel=1e-7, abs=1e-12)
        for p in (0.001, 0.05, 0.5, 0.8, 0.975, 0.9999):
            assert st.t_ppf(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-7, abs=1e-9)


# --- tau and acceptance ---------------------------------------------------------------------------

def test_tau_hand_checked():
    est = st.tau_estimate([[3, 1, 4], [2, 2]])
    assert est.value == 2.4  # 12 tokens / 5 steps, exactly
    # by hand: y = [8, 4], x = [3, 2], residuals y - 2.4 x = [0.8, -0.8];
    # se = sqrt(2/1 * 1.28) / 5 = 0.32; t_{0.975,1} = 12.706205
    assert est.se == pytest.approx(0.32, rel=1e-12)
    assert est.df == 1 and est.n == 2
    assert est.lo == pytest.approx(2.4 - 12.706205 * 0.32, abs=1e-5)
    assert est.hi == pytest.approx(2.4 + 12.706205 * 0.32, abs=1e-5)


def test_tau_interval_matches_explicit_numpy_formula():
    rng = np.random.default_rng(0)
    lens = [rng.integers(1, 7, size=rng.integers(3, 40)) for _ in range(10)]
    est = st.tau_estimate(lens)
    y = np.array([l.sum() for l in lens], float)
    x = np.array([len(l) for l in lens], float)
    r = y.sum() / x.sum()
    n = len(lens)
    # linearised variance of a ratio estimator: var(y_j - r x_j) / (n * xbar^2), ddof=1
    se = np.std(y - r * x, ddof=1) / (np.sqrt(n) * x.mean())
    assert est.value == pytest.approx(r, rel=1e-14)
    assert est.se == pytest.approx(se, rel=1e-12)
    assert (est.lo, est.hi) == pytest.approx((r - 2.262157 * se, r + 2.262157 * se), abs=1e-6 * se + 1e-12)


def test_one_prompt_has_no_interval():
    est = st.tau_estimate([[2, 3, 1]])
    assert est.value == 2.0 and math.isnan(est.lo) and math.isnan(est.hi)


def test_acceptance_rates_hand_checked():
    rates = st.acceptance_rates([[2, 1, 0], [1, 1, 1]], [3, 2])
    assert [e.value for e in rates["unconditional"]] == pytest.approx([3 / 5, 2 / 5, 1 / 5], abs=1e-15)
    assert [e.value for e in rates["conditional"]] == pytest.approx([3 / 5, 2 / 3, 1 / 2], abs=1e-15)
    for e in rates["unconditional"] + rates["conditional"]:
        assert 0.0 <= e.lo <= e.value <= e.hi <= 1.0  # clipped to [0, 1]
    with pytest.raises(ValueError, match="n_prompts=2"):
        st.acceptance_rates([[1, 2, 3]], [3, 2])


def _simulate_prompts(rng, n_sets, n_prompts, k, ps):
    """Chain decoding with a per-prompt acceptance probability p (a random effect that makes steps
    of one prompt correlated). Returns per-set arrays y (tokens), x (steps), acc [.., k]."""
    p = rng.choice(ps, size=(n_sets, n_prompts))
    steps = 3 + rng.poisson(20, size=(n_sets, n_prompts))
    flat_p = np.repeat(p.ravel(), steps.ravel())
    ok = rng.random((flat_p.size, k)) < flat_p[:, None]
    lead = np.cumprod(ok, axis=1)  # draft token i is accepted iff tokens 0..i all were
    starts = np.concatenate([[0], np.cumsum(steps.ravel())[:-1]])
    acc = np.add.reduceat(lead, starts, axis=0).reshape(n_sets, n_prompts, k)
    y = steps + acc.sum(-1)  # each step emits its accepted tokens plus the bonus token
    return y, steps, acc


def test_intervals_cover_the_true_value_95_percent():
    rng = np.random.default_rng(1234)
    k, ps = 5, np.array([0.3, 0.5, 0.7, 0.9])
    y, x, acc = _simulate_prompts(rng, 2000, 30, k, ps)
    # steps are independent of p here, so the population ratios are expectations over p
    true_tau = 1 + np.mean([sum(p ** i for i in range(1, k + 1)) for p in ps])
    true_u0 = np.mean(ps)
    true_c1 = np.mean(ps ** 2) / np.mean(ps)
    cover = np.zeros(3)
    for s in range(2000):
        tau = st.ratio_estimate(y[s], x[s])
        u0 = st.ratio_estimate(acc[s, :, 0], x[s])
        c1 = st.ratio_estimate(acc[s, :, 1], acc[s, :, 0])
        cover += [tau.lo <= true_tau <= tau.hi, u0.lo <= true_u0 <= u0.hi, c1.lo <= true_c1 <= c1.hi]
    cover /= 2000
    # 95% nominal; the Monte Carlo se of a coverage is 0.005, so 0.93..0.97 is +-4 se
    assert np.all((cover >= 0.93) & (cover <= 0.97)), cover


# --- throughput ratio -------------------------------------------------------------------------------

def test_ratio_of_means_delta_vs_bootstrap():
    rng = np.random.default_rng(7)
    a = rng.gamma(20.0, 5.0, size=50)  # "spec tok/s", mean 100
    b = rng.gamma(15.0, 4.0, size=60)  # "greedy tok/s", mean 60
    est = st.ratio_of_means(a, b)
    assert est.value == pytest.approx(a.mean() / b.mean(), rel=1e-14)
    n_boot = 20000
    ra = a[rng.integers(0, a.size, (n_boot, a.size))].mean(1)
    rb = b[rng.integers(0, b.size, (n_boot, b.size))].mean(1)
    boot = ra / rb
    lo, hi = np.quantile(boot, [0.025, 0.975])
    width = est.hi - est.lo
    # delta method vs percentile bootstrap: se within 5%, endpoints within 10% of the width
    # (the bootstrap uses the 1/n variance and a skewed ratio, so they are not identical)
    assert est.se == pytest.approx(boot.std(), rel=0.05)
    assert abs(est.lo - lo) < 0.1 * width and abs(est.hi - hi) < 0.1 * width, (est, lo, hi)


def test_ratio_of_means_formula_and_paired():
    a = np.array([10.0, 12.0, 11.0, 13.0])
    b = np.array([5.0, 6.0, 5.5, 7.0])
    est = st.ratio_of_means(a, b)
    r = a.mean() / b.mean()
    ca = a.var(ddof=1) / (4 * a.mean() ** 2)
    cb = b.var(ddof=1) / (4 * b.mean() ** 2)
    assert est.se == pytest.approx(r * math.sqrt(ca + cb), rel=1e-12)
    assert est.df == pytest.approx((ca + cb) ** 2 / (ca ** 2 / 3 + cb ** 2 / 3), rel=1e-12)
    paired = st.ratio_of_means(a, b, paired=True)
    d = a - r * b
    assert paired.se == pytest.approx(d.std(ddof=1) / (2 * b.mean()), rel=1e-12)
    assert paired.se < est.se  # positively correlated pairs: the paired interval is narrower


def test_ratio_of_means_coverage():
    rng = np.random.default_rng(11)
    hits = 0
    for _ in range(2000):
        a = rng.gamma(20.0, 5.0, size=20)
        b = rng.gamma(15.0, 4.0, size=20)
        e = st.ratio_of_means(a, b)
        hits += e.lo <= 100.0 / 60.0 <= e.hi
    assert 0.93 <= hits / 2000 <= 0.97, hits / 2000


# --- TOST ----------------------------------------------------------------------------------------

def test_tost_clearly_equivalent_and_clearly_not():
    rng = np.random.default_rng(3)
    a, b = rng.normal(10.0, 1.0, 200), rng.normal(10.0, 1.0, 200)
    res = st.tost(a, b, margin=1.0)
    assert res.equivalent and res.verdict == "equivalent"
    assert res.p_low < 1e-6 and res.p_high < 1e-6
    assert -1.0 < res.ci_low < res.ci_high < 1.0
    far = st.tost(rng.normal(12.0, 1.0, 200), b, margin=0.5)
    assert not far.equivalent and far.verdict == "not shown equivalent"
    assert far.p_high > 0.999 and far.p_low < 1e-6
    # a small sample cannot show equivalence at a tight margin even with equal means
    small = st.tost(a[:3], b[:3], margin=0.2)
    assert not small.equivalent


def test_tost_borderline_against_table():
    # diff = 0.3, se = 0.1 (df 9), margin 0.5262157: (0.3 - 0.5262157)/0.1 = -t_{0.975,9} -> p_high = 0.025
    res = st.tost_from_estimates(0.3, 0.1, 9, 0.0, 0.0, 1, margin=0.5262157, alpha=0.05)
    assert res.df == pytest.approx(9.0)
    assert res.p_high == pytest.approx(0.025, abs=1e-6)
    assert res.p_low == pytest.approx(st.t_sf(8.262157, 9), rel=1e-12) and res.p_low < 1e-4
    assert res.p == res.p_high and res.equivalent  # 0.025 < 0.05
    assert not st.tost_from_estimates(0.3, 0.1, 9, 0.0, 0.0, 1, margin=0.5262157, alpha=0.02).equivalent
    # the verdict flips where the (1 - 2 alpha) interval touches the margin
    q = st.t_ppf(0.95, 9)
    assert st.tost_from_estimates(0.3, 0.1, 9, 0.0, 0.0, 1, margin=0.3 + q * 0.1 + 1e-6).equivalent
    assert not st.tost_from_estimates(0.3, 0.1, 9, 0.0, 0.0, 1, margin=0.3 + q * 0.1 - 1e-6).equivalent


def test_tost_welch_by_hand():
    a = np.array([2.1, 2.5, 2.3, 2.8, 2.2, 2.6])
    b = np.array([2.0, 2.9, 2.4, 2.7, 2.1, 2.2, 2.5, 3.0])
    res = st.tost(a, b, margin=(-0.4, 0.3), alpha=0.05)
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    d = a.mean() - b.mean()
    assert res.se == pytest.approx(se, rel=1e-12) and res.df == pytest.approx(df, rel=1e-12)
    assert res.p_low == pytest.approx(1 - st.t_cdf((d + 0.4) / se, df), abs=1e-12)
    assert res.p_high == pytest.approx(st.t_cdf((d - 0.3) / se, df), abs=1e-12)
    assert res.equivalent == (res.ci_low > -0.4 and res.ci_high < 0.3)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="at least 2"):
        st.tost([1.0], [1.0, 2.0], 0.1)
    with pytest.raises(ValueError, match="margin"):
        st.tost([1.0, 2.0], [1.0, 2.0], (0.1, -0.1))
    with pytest.raises(ValueError, match="one value per cluster"):
        st.ratio_estimate([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="non-finite"):
        st.ratio_of_means([1.0, float("nan")], [1.0, 2.0])


# --- equivalence margins and proportions (task accuracy) ------------------------------------------

def test_equivalence_margins_by_hand():
    # diff -0.02, se 0.01, df 9, alpha 0.05: t_{0.95,9} = 1.833113 (t table)
    m = st.equivalence_margins(-0.02, 0.01, 9, 0.05)
    assert m["quantile"] == pytest.approx(1.833113, abs=1e-6)
    assert m["margin_floor"] == pytest.approx(0.01833113, abs=1e-8)
    assert m["smallest_margin"] == pytest.approx(0.03833113, abs=1e-8)
    # it is where the TOST verdict flips (1e-6 either side)
    ok = st.tost_from_estimates(-0.02, 0.01, 9, 0.0, 0.0, 1, margin=m["smallest_margin"] + 1e-6, alpha=0.05)
    no = st.tost_from_estimates(-0.02, 0.01, 9, 0.0, 0.0, 1, margin=m["smallest_margin"] - 1e-6, alpha=0.05)
    assert ok.equivalent and not no.equivalent
    assert st.equivalence_margins(0.03, 0.0, math.inf, 0.01)["smallest_margin"] == 0.03  # no noise: |diff|
    with pytest.raises(ValueError, match="alpha"):
        st.equivalence_margins(0.0, 0.01, 9, 0.5)
    with pytest.raises(ValueError, match="standard error"):
        st.equivalence_margins(0.0, math.nan, 9, 0.05)


def test_proportion_estimate_by_hand():
    e = st.proportion_estimate(3, 4)
    # p = 0.75, se = sqrt(0.75 * 0.25 / 4) = 0.216506; 0.75 +- 1.959964 * se, the top clipped at 1
    assert e.value == 0.75 and e.se == pytest.approx(0.2165064, abs=1e-7) and e.df == math.inf
    assert e.lo == pytest.approx(0.75 - 1.959964 * 0.2165064, abs=1e-6) and e.hi == 1.0
    assert st.proportion_estimate(4, 4).se == 0.0  # all pass: no spread
    with pytest.raises(ValueError, match="successes <= n"):
        st.proportion_estimate(5, 4)


def test_tost_proportions_reproduces_the_nemotron_card():
    # the card's GSM8K numbers: n = 1319 per arm, 0.6869 (906/1319) against 0.6823 (900/1319)
    n, ka, kb = 1319, 906, 900
    pa, pb = ka / n, kb / n
    res = st.tost_proportions(ka, n, kb, n, margin=0.05, alpha=0.01)
    se = math.sqrt(pa * (1 - pa) / n + pb * (1 - pb) / n)
    assert res.se == pytest.approx(se, rel=1e-12) and res.df == math.inf
    assert round(res.se, 3) == 0.018  # "the standard error of the difference is 0.018"
    d = pa - pb
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    assert res.p_low == pytest.approx(1 - phi((d + 0.05) / se), abs=1e-12)
    assert res.p_high == pytest.approx(phi((d - 0.05) / se), abs=1e-12)
    assert res.p < 0.01 and res.equivalent  # "both rejected at p < 0.01"
    # the card's margins are at the 90% interval (alpha 0.05): no margin below +-0.030, and this
    # difference supports +-0.035 (its 0.0343 rounded up to the third decimal)
    m = st.equivalence_margins(res.diff, res.se, res.df, 0.05)
    assert m["margin_floor"] == pytest.approx(1.644854 * se, abs=1e-6) and round(m["margin_floor"], 3) == 0.030
    assert 0.034 < m["smallest_margin"] <= 0.035


def test_tost_proportions_small_sample_and_no_variation():
    # 3/4 against 2/4: se = sqrt(0.1875/4 + 0.25/4) = 0.3307189; at +-0.05 nothing can be shown:
    # p_high = Phi((0.25 - 0.05) / se) = Phi(0.6047) = 0.7273
    res = st.tost_proportions(3, 4, 2, 4, margin=0.05, alpha=0.01)
    assert res.diff == 0.25 and res.se == pytest.approx(0.3307189, abs=1e-7)
    assert not res.equivalent and res.p_high == pytest.approx(0.5 * math.erfc(-(0.25 - 0.05) / 0.3307189 / math.sqrt(2)),
                                                              abs=1e-7)  # se given to 7 decimals
    # one arm without spread still has a standard error from the other
    assert st.tost_proportions(4, 4, 3, 4, margin=0.05).se == pytest.approx(math.sqrt(0.1875 / 4), abs=1e-12)
    with pytest.raises(ValueError, match="no variation in either arm"):
        st.tost_proportions(4, 4, 4, 4, margin=0.05)
