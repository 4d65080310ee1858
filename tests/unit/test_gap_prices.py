"""`qgpu.gap_prices`: hand-worked prices, the column generation against the LP over every
pattern, duality, and the rules on its input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from qgpu.gap_prices import BEYOND, price_gaps


def test_lone_81s_are_what_the_mix_leaves_out():
    # 81% and 47% shares, equally often. Per arrival the mix needs 0.5 GPU for the 81s
    # (alone) and 0.25 for the 47s (two to a GPU); the priced cluster has 0.98 x 0.64 GPUs,
    # so some must be left out: the 81s, the pattern that fills least (81 vs 94). A GPU is
    # then worth 81, and 47 + 47 adds up to exactly that: each 47 is worth 40.5 (price 6.5).
    prices = price_gaps({81: 1, 47: 1}, {}, max_items=4)
    assert prices.gpu_value == 81.0
    assert prices.reduced == {47: 40.5, 81: 81.0}
    assert prices.price == {47: 6.5, 81: 0.0}
    v = prices.values
    assert (v[46], v[47], v[80], v[81], v[93], v[94], v[100]) == (0, 40.5, 40.5, 81, 81, 81, 81)
    # every 47 goes two to a GPU (0.25 GPU), the 81s get the other 0.3772 of the 0.6272
    assert prices.filled == pytest.approx((0.25 * 94 + (0.6272 - 0.25) * 81) / 0.6272)


def test_a_mix_that_packs_exactly_is_worth_its_size():
    prices = price_gaps({50: 3}, {}, max_items=4)
    assert prices.gpu_value == 100.0
    assert prices.reduced == {50: 50.0}
    assert (prices.values[49], prices.values[50], prices.values[99], prices.values[100]) == (
        0,
        50,
        50,
        100,
    )


def test_only_the_proportions_count():
    mix = {81: 5, 65: 2, 32: 3, 23: 1}
    a = price_gaps(mix, {1: 4, 8: 1}, max_items=4)
    b = price_gaps({c: 7 * w for c, w in mix.items()}, {1: 28, 8: 7}, max_items=4)
    assert a.reduced == b.reduced and a.gpu_value == b.gpu_value
    assert a.values.tolist() == b.values.tolist()
    # the same mix is priced once per process (engines made for one decision price the
    # live slices every time); what callers share cannot be changed
    assert a is b
    with pytest.raises(ValueError, match="read-only"):
        a.values[0] = 1.0
    with pytest.raises(TypeError):
        a.reduced[81] = 0.0  # type: ignore[index]


def test_whole_gpus_alone_leave_every_gap_worthless():
    prices = price_gaps({}, {1: 3, 2: 1}, max_items=4)
    assert prices.values.tolist() == [0.0] * 101 and prices.reduced == {}


@pytest.mark.parametrize(
    ("shares", "whole", "max_items", "beyond", "field"),
    [
        ({0: 1}, {}, 4, BEYOND, "share core must be 1..99, got 0"),
        ({100: 1}, {}, 4, BEYOND, "share core must be 1..99, got 100"),
        ({30: 1}, {}, 0, BEYOND, "max_items must be >= 1, got 0"),
        ({30: 1}, {}, 4, 0.0, "beyond must be between 0 and 1, got 0.0"),
        ({30: 1}, {}, 4, 1.0, "beyond must be between 0 and 1, got 1.0"),
        ({30: -1}, {}, 4, BEYOND, "weight of share 30 must be a number >= 0, got -1"),
        ({30: 1}, {2: float("nan")}, 4, BEYOND, "weight of whole-GPU request 2 must be a number"),
        ({30: 1}, {0: 1}, 4, BEYOND, "whole-GPU count must be >= 1, got 0"),
    ],
)
def test_bad_input_is_refused_by_name(shares, whole, max_items, beyond, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(".", r"\.")):
        price_gaps(shares, whole, max_items, beyond)


def _all_patterns(sizes: list[int], max_items: int) -> list[tuple[int, ...]]:
    return [
        combo
        for n in range(1, max_items + 1)
        for combo in itertools.combinations_with_replacement(sizes, n)
        if sum(combo) <= 100
    ]


def _full_lp(shares: dict[int, int], whole: dict[int, int], max_items: int) -> float:
    """The LP's optimum (core filled) over every pattern, written out directly."""
    sizes = sorted(shares)
    counts = sorted(whole)
    total = sum(shares.values()) + sum(whole.values())
    volume = sum(c * w for c, w in shares.items()) + 100 * sum(k * w for k, w in whole.items())
    gpus = (1 - BEYOND) * volume / total / 100
    patterns = _all_patterns(sizes, max_items)
    n = len(patterns) + len(counts)
    a = np.zeros((len(sizes) + 1, n))
    fill = np.zeros(n)
    for j, p in enumerate(patterns):
        for c in p:
            a[sizes.index(c), j] += 1
        a[-1, j] = 1
        fill[j] = sum(p)
    for i, k in enumerate(counts):
        a[-1, len(patterns) + i] = k
        fill[len(patterns) + i] = 100 * k
    b = [shares[c] / total for c in sizes] + [gpus]
    bounds = [(0, None)] * len(patterns) + [(0, whole[k] / total) for k in counts]
    res = linprog(-fill, A_ub=a, b_ub=b, bounds=bounds, method="highs")
    assert res.status == 0
    return -res.fun / gpus


mixes = st.tuples(
    st.dictionaries(st.integers(5, 95), st.integers(1, 20), min_size=1, max_size=6),
    st.dictionaries(st.sampled_from([1, 2, 4, 8]), st.integers(1, 20), max_size=2),
    st.integers(2, 5),
)


@settings(max_examples=60, deadline=None)
@given(mixes)
def test_column_generation_finds_the_optimum_over_every_pattern(mix):
    shares, whole, max_items = mix
    prices = price_gaps(shares, whole, max_items)
    assert prices.filled == pytest.approx(_full_lp(shares, whole, max_items), rel=1e-6)
    # dual feasibility: no pattern's reduced values add up to more than a GPU is worth
    for pattern in _all_patterns(sorted(shares), max_items):
        assert sum(prices.reduced[c] for c in pattern) <= prices.gpu_value + 1e-5
    # the gap values: non-decreasing, never more than the gap, V(100) within a GPU's value
    v = prices.values
    assert np.all(np.diff(v) >= 0) and np.all(v <= np.arange(101) + 1e-9) and v[0] == 0
    assert v[100] <= prices.gpu_value + 1e-5
    for c, r in prices.reduced.items():
        assert prices.price[c] >= 0 and r == pytest.approx(c - prices.price[c])
        assert v[c] >= r - 1e-9
