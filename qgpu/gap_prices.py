"""What a GPU's free gap is worth to the request mix: share sizes priced by the linear
program of packing the mix into GPUs (frag's gap values, `qgpu.frag`).

Owns `GapPrices` and `price_gaps`. The linear program is the textbook relaxation of bin
packing (Gilmore-Gomory): a *pattern* is a set of shares that fit one GPU together (core
adds up to at most 100, at most `max_items` slices); choose how many GPUs get each pattern,
and how many whole-GPU requests run, so that as much GPU core as possible is filled, given
how often each request arrives and how many GPUs there are. Its dual prices every share
size: a share of core ``c`` has price ``pi(c)`` (how much the mix loses when one fewer share
of that size arrives) and a GPU has value ``mu`` (what one more GPU would fill). A share's
*reduced value* is ``c - pi(c)``: what it is worth beside the others. Every pattern's reduced
values add up to at most ``mu``, and the patterns the optimum uses add up to exactly ``mu``.

The value of a gap of ``x`` free qgpu-core is then ``V(x)``, the best sum of reduced values
that fits into ``x``: a gap the mix can close exactly is worth its size, a gap only rare
sizes can close is worth little. Placing a share of core ``c`` into a gap ``x`` loses
``V(x) - V(x - c) - (c - pi(c))`` (never negative), which frag adds to its score.

The mix is priced *just beyond the point where the GPUs run out*: the GPU count is set to
``(1 - BEYOND)`` of the mix's total demand in GPUs, so that some request has to be left out
and the prices say which leaving-out costs least (on the Alibaba traces: lone 81% shares,
``mu`` = 81). Below that point every request fits, every price is the size itself and every
gap is worth 0; far beyond it only the best patterns are used and rare sizes look common.
Only the mix's proportions matter, not its scale or the cluster's size.

The LP is solved by column generation with HiGHS (the `highspy` package, see `_solve`): start from
single-size patterns, add the pattern of highest reduced value (a small knapsack over core
and slice count) while it beats ``mu``, and stop when none does (then the prices are optimal
for all patterns, not only the generated ones).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from qgpu.model import WHOLE_GPU_CORE

# how far beyond the mix's total demand in GPUs the priced cluster is short (see above)
BEYOND = 0.02
# prices are rounded to this many decimals: equal inputs give equal prices on any platform
_DECIMALS = 6
_MAX_ROUNDS = 1000  # column generation stops long before this (one pattern per round)
_EPS = 1e-7


@dataclass(frozen=True)
class GapPrices:
    """The priced mix: per share size its price and reduced value, the value of one GPU
    (`gpu_value`, the dual ``mu``), the value of every gap (`values[x]`, x = 0..100) and of
    every gap with room for at most ``r`` more slices (`by_room[r, x]`, r = 0..max_items;
    the last row is `values`)."""

    price: Mapping[int, float]
    reduced: Mapping[int, float]
    gpu_value: float
    values: np.ndarray
    by_room: np.ndarray
    patterns: int  # how many patterns the column generation needed
    filled: float  # qgpu-core the optimum fills per GPU (the LP's objective / GPUs)


def _unpriced() -> GapPrices:
    """Prices of a mix without shares: every gap is worth 0 (read-only, shared)."""
    by_room = np.zeros((1, WHOLE_GPU_CORE + 1))
    by_room.setflags(write=False)
    values = by_room[-1]
    return GapPrices(MappingProxyType({}), MappingProxyType({}), 0.0, values, by_room, 0, 0.0)


NO_PRICES = _unpriced()


def price_gaps(
    shares: Mapping[int, float],
    whole: Mapping[int, float],
    max_items: int,
    beyond: float = BEYOND,
) -> GapPrices:
    """Price the mix: `shares` maps a share's core (1..99) to how often it arrives, `whole`
    a whole-GPU request's GPU count to how often it arrives; a GPU holds at most `max_items`
    shares. Weights need not add up to anything; only their proportions matter."""
    for kind, weights in (("share", shares), ("whole-GPU request", whole)):
        for key, w in weights.items():
            if not (np.isfinite(w) and w >= 0):
                raise ValueError(f"weight of {kind} {key} must be a number >= 0, got {w}")
    sizes = sorted(c for c, w in shares.items() if w > 0)
    for c in sizes:
        if not 1 <= c < WHOLE_GPU_CORE:
            raise ValueError(f"share core must be 1..99, got {c}")
    counts = sorted(k for k, w in whole.items() if w > 0)
    for k in counts:
        if k < 1:
            raise ValueError(f"whole-GPU count must be >= 1, got {k}")
    if max_items < 1:
        raise ValueError(f"max_items must be >= 1, got {max_items}")
    if not 0 < beyond < 1:
        raise ValueError(f"beyond must be between 0 and 1, got {beyond}")
    if not sizes:
        return NO_PRICES
    total = sum(shares[c] for c in sizes) + sum(whole[k] for k in counts)
    return _priced(
        tuple((c, shares[c] / total) for c in sizes),
        tuple((k, whole[k] / total) for k in counts),
        max_items,
        beyond,
    )


@functools.lru_cache(maxsize=256)
def _priced(
    share_mix: tuple[tuple[int, float], ...],
    whole_mix: tuple[tuple[int, float], ...],
    max_items: int,
    beyond: float,
) -> GapPrices:
    """`price_gaps` for a normalised mix, remembered: engines made for one decision (the
    ledger's reserve, the Ray SDK) price the live slices afresh each time, and the same
    mixes recur."""
    sizes = [c for c, _ in share_mix]
    counts = [k for k, _ in whole_mix]
    demand = np.array([p for _, p in share_mix])
    whole_demand = np.array([p for _, p in whole_mix])
    volume = float(demand @ sizes) + WHOLE_GPU_CORE * float(whole_demand @ counts)
    gpus = (1 - beyond) * volume / WHOLE_GPU_CORE

    size_arr = np.asarray(sizes, dtype=np.int64)
    columns = [_single(i, c, max_items, len(sizes)) for i, c in enumerate(sizes)]
    seen = {tuple(col) for col in columns}
    for _ in range(_MAX_ROUNDS):
        price, gpu_value, filled = _solve(columns, size_arr, demand, counts, whole_demand, gpus)
        reduced = size_arr - price
        best, pattern = _best_pattern(reduced, size_arr, max_items)
        if best <= gpu_value + _EPS or tuple(pattern) in seen:
            break
        columns.append(pattern)
        seen.add(tuple(pattern))
    price = np.round(price, _DECIMALS)
    reduced = np.round(size_arr - price, _DECIMALS)
    by_room = _gap_values(reduced, size_arr, max_items)
    by_room.setflags(write=False)  # shared by every caller of the same mix
    return GapPrices(
        price=MappingProxyType({c: float(p) for c, p in zip(sizes, price, strict=True)}),
        reduced=MappingProxyType({c: float(r) for c, r in zip(sizes, reduced, strict=True)}),
        gpu_value=round(gpu_value, _DECIMALS),
        values=by_room[-1],
        by_room=by_room,
        patterns=len(columns),
        filled=filled / gpus,
    )


def warm_up() -> None:
    """Load the LP solver and solve one tiny mix, so that the first real pricing does not
    pay for the import (~0.15 s) and HiGHS's first call; frag calls this when an engine is
    made (`qgpu.frag.FragPolicy.prepare`). The tiny mix's prices are remembered like any."""
    price_gaps({50: 1.0}, {}, 1)


def _single(i: int, core: int, max_items: int, n: int) -> np.ndarray:
    col = np.zeros(n, dtype=np.int64)
    col[i] = min(max_items, WHOLE_GPU_CORE // core)
    return col


class _Solver(threading.local):
    """One HiGHS instance per thread, made on first use and passed a fresh model each
    solve (HiGHS objects are not safe to share between threads)."""

    highs: Any = None


_SOLVER = _Solver()
# the options scipy's `linprog(method="highs")` passed (presolve forced on, dual simplex);
# every other option stays HiGHS's default
_OPTIONS = (
    ("output_flag", False),
    ("log_to_console", False),
    ("presolve", "on"),
    ("simplex_strategy", 1),  # dual simplex
)
# scipy's feasibility check of a solution reported optimal (sqrt(1e-9) * 10)
_FEASIBLE_TOL = 10 * 1e-9**0.5


def _highs() -> Any:
    if _SOLVER.highs is None:
        # imported on first use: most processes that import qgpu never price a mix
        import highspy

        highs = highspy.Highs()
        for name, value in _OPTIONS:
            highs.setOptionValue(name, value)
        _SOLVER.highs = highs
    return _SOLVER.highs


def _solve(
    columns: list[np.ndarray],
    sizes: np.ndarray,
    demand: np.ndarray,
    counts: list[int],
    whole_demand: np.ndarray,
    gpus: float,
) -> tuple[np.ndarray, float, float]:
    """The restricted LP over `columns`: (price per size, value of a GPU, core filled).

    Maximise the core filled, ``fill @ x``, subject to ``A x <= (demand, gpus)`` and
    ``0 <= x``, a whole-GPU count's ``x`` at most its demand: one column per pattern (its
    shares, and 1 GPU) and per whole-GPU count (its GPUs). HiGHS (the `highspy` package,
    pinned: another version may pivot differently and, where the optimal duals are not
    unique, return other prices) is given the same model and options that scipy's
    `linprog(method="highs")` gave it before, so the prices are those, bit for bit
    (`tests/unit/test_frag_speed.py` keeps linprog's form and compares)."""
    import highspy

    patterns = np.stack(columns, axis=1)  # sizes x patterns
    n_rows, n_pat, n_whole = len(sizes) + 1, patterns.shape[1], len(counts)
    n_cols = n_pat + n_whole
    fill = np.concatenate([sizes @ patterns, WHOLE_GPU_CORE * np.asarray(counts, dtype=float)])
    a = np.zeros((n_cols, n_rows))  # column-major: row c of `a` is column c of the LP
    a[:n_pat, :-1] = patterns.T
    a[:n_pat, -1] = 1.0
    a[n_pat:, -1] = counts
    nonzero = a != 0  # the sparse matrix keeps only nonzeros, by column, rows ascending
    lp = highspy.HighsLp()
    lp.num_col_ = lp.a_matrix_.num_col_ = n_cols
    lp.num_row_ = lp.a_matrix_.num_row_ = n_rows
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(nonzero.sum(axis=1))])
    lp.a_matrix_.index_ = np.nonzero(nonzero)[1]
    lp.a_matrix_.value_ = a[nonzero]
    lp.col_cost_ = -fill
    upper = np.concatenate([np.full(n_pat, np.inf), whole_demand.astype(np.float64)])
    lp.col_lower_ = np.zeros(n_cols)
    lp.col_upper_ = upper
    rhs = np.concatenate([demand, [gpus]])
    lp.row_lower_ = np.full(n_rows, -np.inf)
    lp.row_upper_ = rhs
    highs = _highs()
    highs.passModel(lp)
    highs.run()
    status = highs.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:  # cannot happen for this LP (x = 0 is
        # feasible, fill is bounded)
        raise RuntimeError(f"pricing the request mix failed: {highs.modelStatusToString(status)}")
    solution = highs.getSolution()
    fun = highs.getObjectiveValue()
    x = np.asarray(solution.col_value)
    slack = rhs - np.asarray(solution.row_value)
    tol = _FEASIBLE_TOL
    # linprog's check of a solution HiGHS calls optimal (NaN fails every comparison)
    if not (
        fun == fun and (x >= -tol).all() and (x <= upper + tol).all() and (slack >= -tol).all()
    ):
        raise RuntimeError("pricing the request mix failed: the solution breaks a constraint")
    duals = -np.asarray(solution.row_dual)
    return np.maximum(duals[:-1], 0.0), max(float(duals[-1]), 0.0), -fun


def _knapsack(
    reduced: np.ndarray, sizes: np.ndarray, max_items: int
) -> tuple[np.ndarray, np.ndarray]:
    """value[j, x]: the highest sum of reduced values of exactly j shares whose core adds up
    to exactly x (-inf: none), over shares of positive reduced value; choice[j, x]: the
    index of the size added last to reach it."""
    width = WHOLE_GPU_CORE + 1
    value = np.full((max_items + 1, width), -np.inf)
    value[0, 0] = 0.0
    choice = np.full((max_items + 1, width), -1, dtype=np.int64)
    items = [
        (i, c, v)
        for i, (c, v) in enumerate(zip(sizes.tolist(), reduced.tolist(), strict=True))
        if v > 0
    ]
    for j in range(1, max_items + 1):
        if not np.isfinite(value[j - 1]).any():
            break  # j - 1 shares fit nowhere: neither do j (the rows stay -inf)
        for i, c, v in items:
            cand = value[j - 1, : width - c] + v
            row = value[j, c:]
            better = cand > row + 1e-12
            np.copyto(row, cand, where=better)
            np.copyto(choice[j, c:], i, where=better)
    return value, choice


def _best_pattern(
    reduced: np.ndarray, sizes: np.ndarray, max_items: int
) -> tuple[float, np.ndarray]:
    """The pattern of highest total reduced value (the column generation's pricing step)."""
    value, choice = _knapsack(reduced, sizes, max_items)
    j, x = (int(a) for a in np.unravel_index(int(np.argmax(value)), value.shape))
    pattern = np.zeros(len(sizes), dtype=np.int64)
    best = float(value[j, x])
    while j > 0:
        i = int(choice[j, x])
        pattern[i] += 1
        x -= int(sizes[i])
        j -= 1
    return best, pattern


def _gap_values(reduced: np.ndarray, sizes: np.ndarray, max_items: int) -> np.ndarray:
    """V[r, x], r = 0..max_items, x = 0..100: the best sum of reduced values of at most r
    shares that fit into x free qgpu-core."""
    value, _ = _knapsack(reduced, sizes, max_items)
    at_most = np.maximum.accumulate(value, axis=0)  # at most r shares
    return np.maximum.accumulate(np.maximum(at_most, 0.0), axis=1)


__all__ = ["BEYOND", "NO_PRICES", "GapPrices", "price_gaps", "warm_up"]
