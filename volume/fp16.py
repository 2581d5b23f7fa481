"""Closed-form communication volume of the FP16 all-reduce baseline (PacTrain, paper 002 §IV-C;
PyTorch DDP's ``fp16_compress_hook``).

Every gradient bucket of ``n_b`` float32 entries is cast to half precision (2 bytes per entry)
and summed by one ring all-reduce over all ``p = M P`` ranks (node-major): ``2 (p-1) · 2 n_b``
bytes on the wire in total, half of dense DDP's ``2 (p-1) · 4 n_b``; the intra/inter split
follows the ring's chunking exactly (:func:`volume.dataparallel.world_ring_bytes`).
"""

from __future__ import annotations

from .dataparallel import world_ring_bytes
from .hsadmm import add_bytes

__all__ = ["FP16_ITEMSIZE", "fp16_step_bytes"]

#: bytes of one IEEE 754 half-precision value
FP16_ITEMSIZE = 2


def fp16_step_bytes(*, M: int, P: int, bucket_sizes) -> dict[str, dict]:
    """One step: ``{"fp16_allreduce": {"intra", "inter"}}``, a ring all-reduce of ``n_b``
    half-precision values per bucket (``{}`` without a bucket)."""
    sizes = [int(n) for n in bucket_sizes]
    if not sizes:
        return {}
    return {"fp16_allreduce": add_bytes(*(world_ring_bytes(n, FP16_ITEMSIZE, M, P)
                                          for n in sizes))}
