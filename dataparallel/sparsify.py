"""DGC-style top-k selection with a sampled threshold (Lin et al. 2018; SSFusion §III, §V-A).

The exact top-``k`` of a tensor costs a full selection (``argpartition``) per tensor.  DGC
estimates the magnitude threshold from a small random sample instead:

1. **sample** ``s = max(SAMPLE_MIN, ⌈r n⌉)`` magnitudes (``--sample-ratio r``, default 1 %),
   uniformly with replacement, from a generator seeded by the run seed, the rank, the step and
   the segment (:func:`segment_rng`), and take the ``⌈k s / n⌉``-th largest as threshold
   estimate ``τ̂`` (:func:`sample_magnitudes`, :func:`sample_rank`);
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

import itertools
import math

import numpy as np

from substrate.backend import array_module

from .codec import exact_topk

__all__ = [
    "SAMPLE_MIN",
    "SELECTION_KERNELS",
    "compact_positions",
    "dgc_topk",
    "exact_select",
    "gaussiank_select",
    "refine_threshold",
    "refine_threshold_device",
    "sample_magnitudes",
    "sample_rank",
    "segment_rng",
    "select",
    "selection_flops",
    "selection_kernels",
    "threshold_counts",
]

#: Smallest sample; tensors with at most this many entries are selected exactly.
SAMPLE_MIN = 256

#: Kernel launches of one selection on a device, counted on the device paths below (each array
#: operation one launch, a host read one):
#:
#: * ``dgc`` (:func:`dgc_topk`): ``|x|`` (1); the sample: the indices to the device, the gather
#:   and the sort (3); the counts of every sample threshold (:func:`threshold_counts`:
#:   ``searchsorted``, ``zeros``, ``scatter_add``, ``cumsum``, the difference: 5) and their one
#:   host read (two casts, the concatenation, the read: 4); the candidates
#:   (:func:`compact_positions`: the comparison, ``cumsum``, ``- 1``, ``where``, ``arange``, the
#:   scatter: 6); the trim (gather, ``argpartition``, gather: 3) -- 22;
#: * ``exact`` and tensors too small to sample: ``|x|``, ``argpartition``, the slice's cast (3);
#: * ``gaussiank`` (:func:`_gaussiank_device`): mean, standard deviation, their stack and read
#:   (4), ``|x|`` (1), a comparison and a count for each of the 15 reachable thresholds, their
#:   stack and read (32), the candidates (6) and the trim (3) -- 46;
#: * ``k = n``: the ``arange`` (1).
SELECTION_KERNELS = {"dgc": 22, "exact": 3, "gaussiank": 46}


def segment_rng(seed: int, rank: int, step: int, segment: int) -> np.random.Generator:
    """Sampling generator of one segment (tensor or fused buffer) on one rank in one step,
    seeded from the run seed: reproducible and independent of the
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
        hit = mag >= tau
        c = hit.c if isinstance(hit, _Count) else int(xp.count_nonzero(hit))
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
        See :func:`sample_magnitudes` and :func:`refine_threshold`.
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
    r0 = sample_rank(k, n, int(desc.size))
    if xp is not np:          # on a device: one host read instead of one per pass
        tau, count, _ = refine_threshold_device(mag, k, desc, r0, slack=slack,
                                                max_refine=max_refine)
        cand = xp.arange(n, dtype=np.int64) if count == n else \
            compact_positions(mag >= tau, count)
    else:
        tau, count, _ = refine_threshold(mag, k, desc, r0, slack=slack,
                                         max_refine=max_refine)
        if count == n:
            cand = xp.arange(n, dtype=np.int64)
        else:
            cand = xp.flatnonzero(mag >= tau)
    if count > k:
        cand = cand[xp.argpartition(mag[cand], count - k)[count - k:]]
    return cand.astype(np.int64, copy=False)


def threshold_counts(mag, ascending):
    """``c_j = #{|x| ≥ ascending[j]}`` for every ``j`` in one pass (on the device, no host
    read): each entry's ``searchsorted`` position among the sorted thresholds, histogrammed
    and summed from the top."""
    xp = array_module(mag)
    s = int(ascending.size)
    pos = xp.searchsorted(ascending, mag, side="right")       # #{thresholds <= |x|}
    hist = xp.zeros(s + 1, dtype=np.int64)
    _scatter_add(hist, pos, 1)
    below = xp.cumsum(hist)[:s]                                # #{|x| < ascending[j]}
    return int(mag.size) - below


def _scatter_add(out, positions, values) -> None:
    """``out[positions] += values`` with repeated positions added (``numpy.add.at`` on the
    host, ``cupyx.scatter_add`` on a device: neither reads anything back)."""
    if array_module(out) is np:
        np.add.at(out, positions, values)
        return
    import cupyx  # noqa: PLC0415  optional GPU backend

    cupyx.scatter_add(out, positions, values)


def compact_positions(mask, count: int):
    """``flatnonzero(mask)`` when the number of true entries ``count`` is known on the host:
    positions in increasing order without the host read CuPy's ``flatnonzero`` makes."""
    xp = array_module(mask)
    slot = xp.cumsum(mask, dtype=np.int64) - 1
    slot = xp.where(mask, slot, count)          # the false entries all land in a spare slot
    out = xp.empty(count + 1, dtype=np.int64)
    out[slot] = xp.arange(int(mask.size), dtype=np.int64)
    return out[:count]


def refine_threshold_device(mag, k: int, sample_desc, r: int, *, slack: float = 0.25,
                            max_refine: int = 8) -> tuple[float, int, int]:
    """:func:`refine_threshold` for device arrays with the same result: the counts ``c(τ)`` of
    every sample order statistic come from one pass (:func:`threshold_counts`) and one host
    read of ``(sample, counts)``; the passes then look them up instead of counting."""
    xp = array_module(mag)
    s = int(sample_desc.size)
    counts = threshold_counts(mag, sample_desc[::-1])          # ascending order
    both = xp.concatenate([sample_desc.astype(np.float64), counts.astype(np.float64)]).get()
    desc_h = both[:s].astype(sample_desc.dtype)
    c_desc = both[s:][::-1].astype(np.int64)                  # c(desc[r-1]) at r-1
    return refine_threshold(_Counted(desc_h, c_desc, int(mag.size)), k, desc_h, r,
                            slack=slack, max_refine=max_refine)


class _Counted:
    """Stands in for ``mag`` in :func:`refine_threshold` with the counts precomputed: ``mag
    >= tau`` answers from the table (``tau`` is always a sample value)."""

    def __init__(self, desc, counts, n: int) -> None:
        self._at = {float(v): int(c) for v, c in zip(desc, counts)}
        self.size = n

    def __ge__(self, tau):
        return _Count(self._at[float(tau)])


class _Count:
    __slots__ = ("c",)

    def __init__(self, c: int) -> None:
        self.c = c


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
    from scipy.special import ndtri  # noqa: PLC0415  17 MiB a rank, only Gaussian-k needs it

    if xp is not np:
        return _gaussiank_device(x, k, float(ndtri(1.0 - k / (2.0 * n))))
    mu, sigma = float(x.mean()), float(x.std())
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


def _gaussiank_device(x, k: int, z: float):
    """:func:`gaussiank_select` on a device with two host reads instead of up to six: the
    moments, then the counts of every threshold the three rescalings can reach (15), so the
    host walks the same path; the candidates are compacted with their count known."""
    xp = array_module(x)
    mu, sigma = (float(v) for v in xp.stack([x.mean(), x.std()]).get())
    tau0 = mu + sigma * z
    paths = [p for depth in range(4) for p in itertools.product((0.5, 1.5), repeat=depth)]
    taus = {}
    for p in paths:
        t = tau0
        for f in p:
            t *= f
        taus[p] = t
    order = list(taus)
    mag = xp.abs(x)
    counts = xp.stack([xp.count_nonzero(mag > taus[p]) for p in order]).get()
    c_of = dict(zip(order, (int(c) for c in counts)))
    path: tuple = ()
    for _ in range(3):
        c = c_of[path]
        if c < 2 * k / 3:
            path += (0.5,)
        elif c > 4 * k / 3:
            path += (1.5,)
        else:
            break
    tau, count = taus[path], c_of[path]
    cand = compact_positions(mag > tau, count)
    if count > k:
        cand = cand[xp.argpartition(mag[cand], count - k)[count - k:]]
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
    clock's ``flops`` compute source turns into seconds; a model estimate, not a measurement).

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


def selection_kernels(n: int, k: int, sparsifier: str = "dgc",
                      sample_ratio: float = 0.01) -> int:
    """Kernel launches of one top-``k`` selection of ``n`` entries on a device
    (:data:`SELECTION_KERNELS`): what a selection costs beyond its element operations, a launch
    overhead each, whatever the tensor's size -- so sparsifying tensor by tensor pays it once per
    tensor (SSFusion §III-A, Table III's ~0.85 ms floor for small tensors)."""
    n, k = int(n), int(k)
    if n <= 0:
        return 0
    if k >= n:
        return 1
    if sparsifier not in SELECTION_KERNELS:
        raise ValueError(f"sparsifier {sparsifier!r} unknown; use one of "
                         f"{sorted(SELECTION_KERNELS)}")
    if sparsifier == "dgc" and max(SAMPLE_MIN, math.ceil(sample_ratio * n)) >= n:
        return SELECTION_KERNELS["exact"]
    return SELECTION_KERNELS[sparsifier]
