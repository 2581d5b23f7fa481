"""DGC-style top-k selection with a sampled threshold (Lin et al. 2018; SSFusion §III, §V-A).

The exact top-``k`` of a tensor costs a full selection (``argpartition``) per tensor.  DGC
estimates the magnitude threshold from a small random sample instead:

1. **sample** ``s = max(SAMPLE_MIN, ⌈r n⌉)`` magnitudes (``--sample-ratio r``, default 1 %),
   uniformly with replacement, from a generator seeded by the run seed, the rank, the step and
   the segment (:func:`segment_rng`), and take the ``⌈k s / n⌉``-th largest as threshold
   estimate ``τ̂`` (:func:`sample_threshold`);
2. **refine** ``τ`` toward the target count: count ``c(τ) = #{|x| ≥ τ}``, keep ``τ`` when
   ``k ≤ c ≤ (1 + slack) k``, otherwise move to another order statistic of the sorted sample,
   rescaling its rank by ``k / c``, for at most ``max_refine`` passes (:func:`refine_threshold`);
   the returned threshold always satisfies ``c(τ) ≥ k`` (``τ = 0`` in the worst case);
3. **trim** the candidates ``{|x| ≥ τ}`` (a superset of the exact top-``k``) to exactly ``k``
   with a selection over the few candidates only (:func:`dgc_topk`).

The result is the exact top-``k`` set (up to ties) at the cost of a few linear passes, and the
count is exactly ``k``, so the all-gather payload is fixed and predicted in closed form.
Works on NumPy and CuPy arrays alike.
"""

from __future__ import annotations

import math

import numpy as np

from substrate.backend import array_module

from .codec import exact_topk

__all__ = [
    "SAMPLE_MIN",
    "dgc_topk",
    "exact_select",
    "gaussiank_select",
    "refine_threshold",
    "sample_magnitudes",
    "sample_rank",
    "sample_threshold",
    "segment_rng",
    "select",
    "selection_flops",
]

#: Smallest sample; tensors with at most this many entries are selected exactly.
SAMPLE_MIN = 256


def segment_rng(seed: int, rank: int, step: int, segment: int) -> np.random.Generator:
    """Sampling generator of one segment (tensor or fused buffer) on one rank in one step,
    seeded from the run seed (DESIGN.md convention 6): reproducible and independent of the
    order in which segments are processed (the offload worker runs them out of order)."""
    return np.random.default_rng([int(seed), int(rank), int(step), int(segment)])


def sample_magnitudes(mag, sample_ratio: float, rng: np.random.Generator):
    """``s = max(SAMPLE_MIN, ⌈r n⌉)`` magnitudes drawn uniformly with replacement, sorted in
    descending order (``None`` when ``s ≥ n``: select exactly)."""
    xp = array_module(mag)
    n = int(mag.size)
    s = max(SAMPLE_MIN, math.ceil(sample_ratio * n))
    if s >= n:
        return None
    sample = mag[xp.asarray(rng.integers(0, n, size=s))]
    return xp.sort(sample)[::-1]


def sample_rank(k: int, n: int, s: int) -> int:
    """Rank (1-based, descending) in an ``s``-sample whose value estimates the ``k``-th largest
    of ``n``: ``⌈k s / n⌉``."""
    return min(s, max(1, math.ceil(k * s / n)))


def sample_threshold(mag, k: int, sample_ratio: float, rng: np.random.Generator) -> float:
    """Threshold estimate ``τ̂``: the ``⌈k s / n⌉``-th largest of ``s`` sampled magnitudes.

    Parameters
    ----------
    mag : array (n,)
        Magnitudes ``|x|`` (NumPy or CuPy).
    k : int
        Target count, ``1 ≤ k ≤ n``.
    sample_ratio : float
        ``r`` in ``s = max(SAMPLE_MIN, ⌈r n⌉)``; with ``s ≥ n`` the exact ``k``-th largest.
    rng : numpy.random.Generator

    Returns
    -------
    float
    """
    xp = array_module(mag)
    desc = sample_magnitudes(mag, sample_ratio, rng)
    if desc is None:
        n = int(mag.size)
        return float(xp.partition(mag, n - k)[n - k])
    return float(desc[sample_rank(k, int(mag.size), int(desc.size)) - 1])


def refine_threshold(mag, k: int, sample_desc, r: int, *, slack: float = 0.25,
                     max_refine: int = 8) -> tuple[float, int, int]:
    """Move the threshold along the sorted sample until ``k ≤ c(τ) ≤ (1 + slack) k``.

    Starting from ``τ = sample_desc[r-1]``, each counting pass ``c = #{|x| ≥ τ}`` rescales the
    sample rank by the observed ratio, ``r ← r (1 + slack/2) k / c`` (rounded away from the
    current rank), so a poor first estimate is fixed in one or two passes.

    Returns
    -------
    (tau, count, passes)
        The highest threshold seen with ``c(tau) = count ≥ k`` (``tau = 0``, every entry, when
        none was found) and the number of counting passes made.
    """
    xp = array_module(mag)
    n, s = int(mag.size), int(sample_desc.size)
    lo, lo_count, passes = 0.0, n, 0
    tried: set[int] = set()
    while passes <= max_refine and r not in tried:
        tried.add(r)
        tau = float(sample_desc[r - 1])
        c = int(xp.count_nonzero(mag >= tau))
        passes += 1
        if c >= k:
            if c < lo_count:
                lo, lo_count = tau, c
            if c <= (1 + slack) * k:
                break
            r = max(1, min(r - 1, math.floor(r * (1 + slack / 2) * k / c)))
        else:
            if r == s:
                break
            r = min(s, max(r + 1, math.ceil(r * (1 + slack / 2) * k / max(c, 1))))
    return lo, lo_count, passes


def dgc_topk(x, k: int, rng: np.random.Generator, sample_ratio: float = 0.01, *,
             slack: float = 0.25, max_refine: int = 8):
    """Positions of the ``k`` largest ``|x|`` (unordered, int64) via sample → refine → trim.

    Parameters
    ----------
    x : array (n,)
        One tensor (or fused buffer), NumPy or CuPy.
    k : int
        ``1 ≤ k ≤ n``; ``k = n`` returns every position.
    rng : numpy.random.Generator or tuple
        From :func:`segment_rng`, or its ``(seed, rank, step, segment)`` key (the generator is
        then built only when the tensor is large enough to be sampled).
    sample_ratio, slack, max_refine
        See :func:`sample_threshold` and :func:`refine_threshold`.
    """
    xp = array_module(x)
    n = int(x.size)
    if not 1 <= k <= n:
        raise ValueError(f"top-k needs 1 <= k <= n, got k={k}, n={n}")
    if k == n:
        return xp.arange(n, dtype=np.int64)
    mag = xp.abs(x)
    if max(SAMPLE_MIN, math.ceil(sample_ratio * n)) >= n:  # small: exact selection
        return xp.argpartition(mag, n - k)[n - k:].astype(np.int64, copy=False)
    if not isinstance(rng, np.random.Generator):
        rng = segment_rng(*rng)
    desc = sample_magnitudes(mag, sample_ratio, rng)
    if desc is None:
        return xp.argpartition(mag, n - k)[n - k:].astype(np.int64, copy=False)
    tau, count, _ = refine_threshold(mag, k, desc, sample_rank(k, n, int(desc.size)),
                                     slack=slack, max_refine=max_refine)
    if count == n:
        cand = xp.arange(n, dtype=np.int64)
    else:
        cand = xp.flatnonzero(mag >= tau)
    if cand.size > k:
        cand = cand[xp.argpartition(mag[cand], cand.size - k)[cand.size - k:]]
    return cand.astype(np.int64, copy=False)


#: full top-``k`` (``argpartition``): ``--sparsifier exact``
exact_select = exact_topk


def gaussiank_select(x, k: int):
    """Gaussian-k (Shi et al. 2019 [22]): at most ``k`` positions of large ``|x|``.

    Fit ``x ~ N(μ, σ²)`` and take the threshold ``τ = μ + σ Φ^{-1}(1 - k/(2n))`` (the two-sided
    tail holding ``k`` of ``n``); rescale it at most three times, ``τ ← τ/2`` while fewer than
    ``2k/3`` entries pass and ``τ ← 1.5 τ`` while more than ``4k/3`` do; keep ``{|x| > τ}``,
    trimmed to the ``k`` largest when more pass.  Fewer than ``k`` may be returned (the caller
    pads the fixed-size message with zeros).
    """
    xp = array_module(x)
    n = int(x.size)
    if k >= n:
        return xp.arange(n, dtype=np.int64)
    mu, sigma = float(x.mean()), float(x.std())
    from scipy.special import ndtri

    tau = mu + sigma * float(ndtri(1.0 - k / (2.0 * n)))
    mag = xp.abs(x)
    for _ in range(3):
        c = int(xp.count_nonzero(mag > tau))
        if c < 2 * k / 3:
            tau *= 0.5
        elif c > 4 * k / 3:
            tau *= 1.5
        else:
            break
    cand = xp.flatnonzero(mag > tau)
    if cand.size > k:
        cand = cand[xp.argpartition(mag[cand], cand.size - k)[cand.size - k:]]
    return cand.astype(np.int64, copy=False)



def select(sparsifier: str, x, k: int, key, sample_ratio: float = 0.01):
    """Positions of (at most) ``k`` large ``|x|`` by ``sparsifier``: ``dgc`` (:func:`dgc_topk`,
    sampled with the generator of ``key``, see :func:`segment_rng`), ``gaussiank``
    (:func:`gaussiank_select`, at most ``k``) or ``exact`` (:func:`exact_select`)."""
    if sparsifier == "dgc":
        return dgc_topk(x, k, key, sample_ratio)
    if sparsifier == "gaussiank":
        return gaussiank_select(x, k)
    if sparsifier == "exact":
        return exact_select(x, k)
    raise ValueError(f"sparsifier {sparsifier!r} unknown; use dgc, gaussiank or exact")


def selection_flops(n: int, k: int, sparsifier: str = "dgc", sample_ratio: float = 0.01) -> float:
    """Element operations of one top-``k`` selection of ``n`` entries (the FLOP count the
    timeline's ``flops`` compute source turns into seconds; a model estimate, not a measurement).

    ``dgc``: ``|x|`` (``n``), the sorted sample (``s log2 s``, ``s = max(SAMPLE_MIN, ⌈r n⌉)``),
    two counting passes (``2n``, the typical refinement), the candidate scan (``n``) and the trim
    over at most ``(1 + slack) k`` candidates (``2.5 k``): ``4n + s log2 s + 2.5k``.  ``exact``
    and tensors too small to sample: ``|x|`` and an introselect (``≈ 2n`` comparisons), ``3n``.
    ``gaussiank``: mean and standard deviation (``3n``), ``|x|`` (``n``), at most three counting
    passes (``3n``) and the trim (``2k``): ``7n + 2k``.  ``k = n`` selects everything (``n``).
    """
    n, k = int(n), int(k)
    if n <= 0:
        return 0.0
    if k >= n:
        return float(n)
    if sparsifier == "gaussiank":
        return 7.0 * n + 2.0 * k
    s = max(SAMPLE_MIN, math.ceil(sample_ratio * n))
    if sparsifier == "exact" or s >= n:
        return 3.0 * n
    return 4.0 * n + s * math.log2(s) + 2.5 * k
