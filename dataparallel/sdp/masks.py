"""SDP's mask construction from the model's layers (pure: no MPI, parametrized by the number
of workers ``n``): holder sets as bitmasks over the ranks, N-SDP's windows of neuron chunks and
the groups of layers it masks, B-SDP's residual blocks, and the per-tensor holder-set ids.
:func:`dataparallel.sdp.plan.plan_masks` assembles them into the plan."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from models import (
    BasicBlock,
    BatchNorm2d,
    Bottleneck,
    Conv2d,
    Flatten,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
)
from models.transformer import TransformerBlock

__all__ = ["NeuronGroup", "masked_groups", "neuron_groups", "residual_blocks", "window_sets"]


def _bits(ranks) -> int:
    out = 0
    for r in ranks:
        out |= 1 << int(r)
    return out


def _members(bits: int) -> list[int]:
    return [r for r in range(bits.bit_length()) if bits >> r & 1]


def window_sets(n: int, p: int) -> list[int]:
    """Holder bitmask of chunk ``c``: the window ``{c, ..., c+p-1} mod n`` (``p`` workers per
    chunk, each worker in ``p`` of the ``n`` windows)."""
    return [_bits((c + k) % n for k in range(p)) for c in range(n)]


@dataclass(frozen=True)
class NeuronGroup:
    """One masked layer of neurons/channels.

    Attributes
    ----------
    width : int
        Neurons (channels).
    rows : tuple of str
        Parameters whose axis 0 indexes these neurons (producer weight, bias, BatchNorm).
    cols : tuple of (str, int)
        ``(parameter, repeat)`` whose axis 1 indexes them, ``repeat`` columns per neuron (a
        flattened conv feature map feeding a linear layer).
    buffers : tuple of str
        BatchNorm running statistics indexed by these channels.
    """

    width: int
    rows: tuple[str, ...]
    cols: tuple[tuple[str, int], ...]
    buffers: tuple[str, ...]


def _chain_groups(items: list[tuple[str, object]], what: str) -> list[NeuronGroup]:
    """Masked groups of a forward chain ``[(prefix, layer)]``: the outputs of every conv/linear
    layer but the last, with the BatchNorm that follows and the next layer's input columns."""
    prod_idx = [i for i, (_, layer) in enumerate(items) if isinstance(layer, (Conv2d, Linear))]
    groups = []
    for a, b in itertools.pairwise(prod_idx):
        pa, la = items[a]
        pb, lb = items[b]
        width = la.out_channels if isinstance(la, Conv2d) else la.out_features
        rows = [pa + "weight"] + ([pa + "bias"] if la.bias else [])
        bufs = []
        for pm, mid in items[a + 1:b]:
            if isinstance(mid, BatchNorm2d) and mid.num_features == width:
                rows += [pm + "weight", pm + "bias"]
                bufs += [pm + "running_mean", pm + "running_var"]
            elif not isinstance(mid, (ReLU, MaxPool2d, Flatten)):
                raise ValueError(f"--sdp-mode neuron cannot follow channels through "
                                 f"{type(mid).__name__} in {what}; use --sdp-mode block for "
                                 f"residual models or a cnn/mlp/resnet model")
        fan_in = lb.in_channels if isinstance(lb, Conv2d) else lb.in_features
        if fan_in % width:
            raise ValueError(f"{what}: {pb}weight has {fan_in} inputs, not a multiple of the "
                             f"{width} outputs of {pa}weight; N-SDP needs whole channels")
        groups.append(NeuronGroup(width, tuple(rows), ((pb + "weight", fan_in // width),),
                                  tuple(bufs)))
    return groups


def residual_blocks(model) -> list[tuple[str, object]]:
    """``(prefix, block)`` of every residual block (BasicBlock / Bottleneck, and a transformer's
    pre-norm Attention + MLP block: SDP's block unit on Swin and LLaMA; a shape-only block of a
    paper-scale spec says so with ``residual_block = True``, e.g. Swin-T's), forward order.  A
    block whose tensors are all zero on a worker is the identity there."""
    return [(prefix, layer) for prefix, layer in model.root.walk()
            if isinstance(layer, (BasicBlock, Bottleneck, TransformerBlock))
            or getattr(layer, "residual_block", False)]


def neuron_groups(model) -> list[list[NeuronGroup]]:
    """Chains of masked neuron groups of ``model`` (see the module docstring).

    A model with residual blocks masks each block's inner channels (one chain per block); a
    plain :class:`~models.Sequential` chain masks all its hidden layers.
    """
    blocks = residual_blocks(model)
    if any(isinstance(blk, TransformerBlock) for _, blk in blocks):
        raise ValueError(f"--sdp-mode neuron (over attention heads / MLP neurons) is not "
                         f"implemented for the transformer {model.name!r}; use --sdp-mode "
                         "block or block-backward (SDP over Attention + MLP blocks)")
    if blocks:
        chains = []
        for prefix, blk in blocks:
            main = [(f"{prefix}{name}.", layer) for name, layer in blk.children()
                    if name != "shortcut"]
            chains.append(_chain_groups(main, f"block {prefix[:-1]}"))
        return [c for c in chains if c]
    root = model.root
    if not isinstance(root, Sequential):
        raise ValueError(f"--sdp-mode neuron needs a Sequential model (cnn, mlp, resnet), got "
                         f"{type(root).__name__}")
    chain = _chain_groups([(f"{name}.", layer) for name, layer in root.children()],
                          f"model {model.name}")
    return [chain] if chain else []


def masked_groups(chain: list[NeuronGroup], sizes) -> list[NeuronGroup]:
    """The groups of ``chain`` N-SDP masks: no two adjacent (group ``k``'s input columns are
    group ``k+1``'s producer, so a weight between two masked groups would live on the
    intersection of two holder sets, fewer than ``p`` workers), and among those sets the one
    holding the most parameters (``sizes[name]``: elements of a tensor); a tie masks the
    earlier groups.  A chain of one group (a residual block's inner channels, an MLP's hidden
    layer) masks it."""
    w = [sum(sizes[r] for r in g.rows) + sum(sizes[c] for c, _ in g.cols) for g in chain]
    best: list[tuple[int, tuple[int, ...]]] = [(0, ()), (0, ())]  # best[i]: over chain[:i]
    for i, wi in enumerate(w):
        skip, take = best[i + 1], (best[i][0] + wi, best[i][1] + (i,))
        best.append(take if take[0] > skip[0] else skip)
    return [chain[i] for i in best[-1][1]]


def _popcount(x: int) -> int:
    return int(x).bit_count()


class _SetTable:
    """Distinct holder sets, numbered in order of first use (index 0: all ranks)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sets: list[int] = [(1 << n) - 1]
        self.index = {self.sets[0]: 0}

    def get(self, bits: int) -> int:
        if bits == 0:
            raise ValueError("internal: a coordinate without holders (degree 0)")
        i = self.index.get(bits)
        if i is None:
            i = self.index[bits] = len(self.sets)
            self.sets.append(bits)
        return i


def _tensor_ids(table: _SetTable, shape, rows, cols, repeat: int):
    """Holder-set id and eval scale of every element of one tensor from the bitmasks of its
    rows (axis 0) and columns (axis 1, ``repeat`` per neuron); ``None``: held by all."""
    full = table.sets[0]
    n_out = shape[0]
    n_in = shape[1] if len(shape) > 1 else 1
    rows = [full] * n_out if rows is None else rows
    cols = [full] * (n_in // repeat) if cols is None else cols
    r_uni, r_idx = np.unique(np.array(rows, dtype=object), return_inverse=True)
    c_uni, c_idx = np.unique(np.array(cols, dtype=object), return_inverse=True)
    pair_id = np.empty((len(r_uni), len(c_uni)), dtype=np.int32)
    pair_scale = np.empty((len(r_uni), len(c_uni)), dtype=np.float64)
    for a, ra in enumerate(r_uni):
        for b, cb in enumerate(c_uni):
            both = int(ra) & int(cb)
            pair_id[a, b] = table.get(both)
            pair_scale[a, b] = _popcount(both) / _popcount(int(ra))
    c_idx = np.repeat(c_idx, repeat)
    if len(shape) == 1:
        return pair_id[r_idx, 0], pair_scale[r_idx, 0]
    ids = pair_id[r_idx[:, None], c_idx[None, :]]
    scale = pair_scale[r_idx[:, None], c_idx[None, :]]
    extra = (1,) * (len(shape) - 2)
    return (np.broadcast_to(ids.reshape(ids.shape + extra), shape),
            np.broadcast_to(scale.reshape(scale.shape + extra), shape))
