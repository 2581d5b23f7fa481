"""Simulated clock: measured compute plus modeled communication, per rank.

A run on one laptop reports the time the same run would take on the modeled cluster:
``sim_s = compute_s + comm_modeled_s`` where ``compute_s`` is measured around the compute
sections (``with clock.compute(): ...``) and ``comm_modeled_s`` is the α–β time of every call in
the ledger.  Communication is not overlapped with compute in this accounting (an upper bound for
systems that overlap, stated as such in reports).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from .ledger import Ledger

__all__ = ["SimClock"]


class SimClock:
    """Per-rank measured compute and modeled communication time."""

    def __init__(self, ledger: Ledger, sync=None) -> None:
        self.ledger = ledger
        self.compute_s = 0.0
        self._sync = sync  # e.g. Backend.synchronize so GPU kernels are timed, not launched
        self._t0 = time.perf_counter()

    @contextmanager
    def compute(self):
        """Time the enclosed block as compute."""
        if self._sync:
            self._sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                self._sync()
            self.compute_s += time.perf_counter() - t

    @property
    def comm_modeled_s(self) -> float:
        return self.ledger.modeled_s

    @property
    def sim_s(self) -> float:
        return self.compute_s + self.comm_modeled_s

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self._t0

    def as_dict(self) -> dict:
        return {"wall_s": self.wall_s, "compute_s": self.compute_s,
                "comm_modeled_s": self.comm_modeled_s, "sim_s": self.sim_s}
