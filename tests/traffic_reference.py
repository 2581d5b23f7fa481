"""Brute-force traffic references for tests: walk an algorithm's schedule message by message and
charge each message to the link it takes.  Written from the algorithms, independently of
``substrate.costmodel``'s closed forms and per-rank accounting, so tests can hold those equal."""

import numpy as np

__all__ = ["simulated_bcast", "simulated_ring"]


def simulated_ring(count, itemsize, nodes):
    """Ring all-reduce over ranks on ``nodes`` (ring order) of ``count`` elements cut into
    ``numpy.array_split`` chunks (reduce-scatter step s: rank i sends chunk (i-s) % p to i+1;
    all-gather step s: chunk (i+1-s) % p).  Returns ``{"intra": bytes, "inter": bytes}``."""
    nodes = np.asarray(nodes)
    p = nodes.size
    sizes = [len(c) for c in np.array_split(np.arange(int(count)), p)]
    out = {"intra": 0, "inter": 0}
    for i in range(p):
        link = "inter" if nodes[i] != nodes[(i + 1) % p] else "intra"
        for s in range(p - 1):
            out[link] += (sizes[(i - s) % p] + sizes[(i + 1 - s) % p]) * itemsize
    return out


def simulated_bcast(nbytes, nodes, root=0):
    """Binomial broadcast of ``nbytes`` from ``root``: walk the tree from the root (relative rank
    r sends to r + 2^k for every 2^k below its lowest set bit) and charge every edge."""
    nodes = np.asarray(nodes)
    p = nodes.size
    out = {"intra": 0, "inter": 0}
    todo = [0]
    while todo:
        rel = todo.pop()
        low = rel & -rel if rel else 1 << max(p - 1, 0).bit_length()
        mask = 1
        while mask < low and rel + mask < p:
            kid = rel + mask
            a, b = (rel + root) % p, (kid + root) % p
            out["intra" if nodes[a] == nodes[b] else "inter"] += nbytes
            todo.append(kid)
            mask <<= 1
    return out
