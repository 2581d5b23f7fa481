"""PacTrain's TernGrad codec (paper 002, eq. 3; Wen et al. 2017): ternarize, pack 2 bits.

``s = max|g|`` per tensor (or per packed vector), ``b ~ Bernoulli(|g|/s)`` from a per-rank,
per-step stream seeded ``[seed, TERNARY_STREAM, rank, step]`` (:func:`ternary_uniforms`), codes
``sign(g) · b`` (:func:`ternarize`) packed 4 per byte (:func:`pack_2bit`,
:func:`unpack_2bit`); every rank decodes and averages ``(s/p) Σ_j sign(g_j) b_j``, an unbiased
estimate of the average.
"""

from __future__ import annotations

import numpy as np

from substrate.backend import array_module

__all__ = ["TERNARY_STREAM", "pack_2bit", "ternarize", "ternary_uniforms", "unpack_2bit"]

#: Second word of the ternary streams' seed ``[seed, TERNARY_STREAM, rank, step]``.
TERNARY_STREAM = 2002


def ternary_uniforms(seed: int, rank: int, step: int, n: int, dtype=np.float32) -> np.ndarray:
    """The uniforms ``u ∈ [0, 1)`` rank ``rank`` draws at ``step`` for the Bernoulli variables
    ``b = [u < |g|/s]``: ``default_rng([seed, TERNARY_STREAM, rank, step]).random(n)``
    (reproducible, independent of the global RNG, different on every rank and step)."""
    return np.random.default_rng([int(seed), TERNARY_STREAM, int(rank), int(step)]).random(
        int(n), dtype=dtype)


def ternarize(g, s, u):
    """TernGrad codes (paper §III-D): ``sign(g) · b`` with ``b = [u < |g|/s]``, as ``int8`` in
    ``{−1, 0, +1}``.

    ``s · ternarize(g, s, u)`` is unbiased, ``E = s · sign(g) · |g|/s = g`` (eq. 3), when
    ``s ≥ |g|`` elementwise and ``u ~ U[0, 1)``.  ``s`` is a scalar or one scale per element
    (broadcast); where ``s = 0`` the code is 0.
    """
    xp = array_module(g)
    s = xp.asarray(s, dtype=g.dtype)
    pos = s > 0
    b = (u < xp.abs(g) / xp.where(pos, s, 1)) & pos
    return (xp.sign(g) * b).astype(np.int8)


_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_DECODE = np.array([0, 1, 0, -1], dtype=np.int8)  # 2-bit code -> value (code 2 unused)


def pack_2bit(codes, out=None):
    """Pack ternary values ``{−1, 0, +1}`` (int8) into 2-bit codes, 4 per byte.

    Code of a value: ``0 → 0b00``, ``+1 → 0b01``, ``−1 → 0b11``; value ``i`` lands in byte
    ``i // 4`` at bit ``2 (i % 4)``; the tail is padded with zeros.  Returns (or fills ``out``)
    a ``uint8`` array of ``⌈n/4⌉`` bytes.
    """
    xp = array_module(codes)
    n = codes.shape[0]
    nb = -(-n // 4)
    c = xp.zeros(4 * nb, dtype=np.uint8)
    c[:n] = codes.view(np.uint8) & 3
    c = c.reshape(nb, 4) << xp.asarray(_SHIFTS)
    res = c[:, 0] | c[:, 1] | c[:, 2] | c[:, 3]
    if out is None:
        return res
    out[...] = res
    return out


def unpack_2bit(packed, n: int):
    """Inverse of :func:`pack_2bit`: ``(..., ⌈n/4⌉)`` bytes → ``(..., n)`` int8 values (a 2-D
    input decodes every rank's row at once)."""
    xp = array_module(packed)
    codes = (packed[..., :, None] >> xp.asarray(_SHIFTS)) & 3
    codes = codes.reshape(*packed.shape[:-1], -1)[..., :n]
    return xp.asarray(_DECODE)[codes]


#: what ``--init`` reads (its help, the README and every refusal say it)
