"""Greedy, order-preserving buckets of tensors (pure: no MPI; plans and configs import it).

PyTorch DDP and PruneX §4.4 coalesce consecutive tensors into buckets of at most ~32 MiB and
reduce each bucket with one collective.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BucketPlan", "bucket_groups"]


def bucket_groups(nbytes, bucket_bytes: int, keys=None) -> list[list[int]]:
    """Greedy, order-preserving grouping of items of ``nbytes[i]`` bytes into buckets of at most
    ``bucket_bytes`` (an item larger than a bucket gets one of its own; a change of ``keys[i]``,
    e.g. the dtype, starts a new bucket).  Returns lists of item indices."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, nb in enumerate(nbytes):
        if cur and (cur_bytes + nb > bucket_bytes or (keys is not None and keys[i] != keys[cur[0]])):
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nb
    if cur:
        groups.append(cur)
    return groups


class BucketPlan:
    """Assignment of tensors to contiguous buckets (:func:`bucket_groups`) with the flat bucket
    buffers allocated once."""

    def __init__(self, shapes_dtypes, bucket_bytes: int, xp) -> None:
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape, _ in shapes_dtypes]
        dtypes = [np.dtype(d) for _, d in shapes_dtypes]
        groups = bucket_groups([s * d.itemsize for s, d in zip(sizes, dtypes)], bucket_bytes,
                               dtypes)
        self.buckets: list[list[tuple[int, int, int]]] = []  # (tensor idx, offset, size)
        self.buffers = []
        for g in groups:
            offs = np.concatenate(([0], np.cumsum([sizes[i] for i in g])[:-1]))
            self.buckets.append([(i, int(o), sizes[i]) for i, o in zip(g, offs)])
            self.buffers.append(xp.empty(sum(sizes[i] for i in g), dtype=dtypes[g[0]]))
