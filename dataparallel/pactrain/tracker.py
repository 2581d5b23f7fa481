"""PacTrain's mask tracker (paper 002, Alg. 1 l. 6-11): is a bucket's mask stable?

One :class:`MaskTracker` per gradient bucket (``--mask-scope bucket``, Algorithm 1's
``foreach update ∈ model_updates``) or one for the whole flat gradient (``global``) watches the
mask ``m_t = (θ_t ≠ 0)``; after ``--stable-window`` unchanged comparisons the bucket's survivors
are packed and all-reduced compactly (:class:`dataparallel.pactrain.PacTrain`).
"""

from __future__ import annotations

import numpy as np

from substrate.backend import array_module

__all__ = ["MaskTracker"]


class MaskTracker:
    """Detects when the gradient mask has stopped changing (paper §III-C, "Mask Tracker").

    :meth:`observe` compares each step's mask with the previous one; after ``window``
    consecutive unchanged comparisons the mask is *stable* (packed mode).  A change resets the
    count and bumps :attr:`version` (the packed index set is re-planned once per version).

    Parameters
    ----------
    window : int
        Consecutive unchanged comparisons required (0: stable from the first observation).
    """

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError(f"--stable-window must be >= 0, got {window}")
        self.window = int(window)
        self._prev = None
        self.unchanged = 0
        self.version = 0

    def observe(self, mask) -> bool:
        """Record this step's mask; returns whether it is stable (``unchanged >= window``)."""
        xp = array_module(mask)
        if self._prev is None or self._prev.shape != mask.shape or not bool(
                xp.array_equal(self._prev, mask)):
            self._prev = mask.copy()
            self.unchanged = 0
            self.version += 1
        else:
            self.unchanged += 1
        return self.stable

    @property
    def stable(self) -> bool:
        return self._prev is not None and self.unchanged >= self.window

    def state_dict(self, host) -> dict:
        """Host copies of the last mask (empty when none was observed) and the counters;
        ``host`` converts a device array to NumPy."""
        return {"prev": host(self._prev).copy() if self._prev is not None
                else np.zeros(0, bool), "has_prev": np.bool_(self._prev is not None),
                "unchanged": np.int64(self.unchanged), "version": np.int64(self.version)}

    def load_state_dict(self, state: dict, xp) -> None:
        self._prev = xp.asarray(state["prev"]) if state["has_prev"] else None
        self.unchanged = int(state["unchanged"])
        self.version = int(state["version"])
