"""Top-K sparsified gradients with error feedback (Aji & Heafield 2017; Lin et al. 2018, DGC).

Every step each rank adds its residual to the fresh gradient, ``a = g + e``, keeps the
``k_l = max(1, ⌈d n_l⌉)`` largest-magnitude entries of every tensor ``l`` (``--density d``,
default 1 %), sends them as ``(float32 value, int32 flat index)`` pairs in one all-gather over
all ranks, and keeps the rest as the new residual ``e = a - sparse(a)``.  The synchronized
gradient is ``(1/p) Σ_j sparse(a_j)``, scattered into the dense flat buffer.
Closed form: :func:`volume.dataparallel.topk_step_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from substrate.backend import array_module
from substrate.calls import Call, Placement, Ready, Work
from substrate.options import option

from .codec import ErrorFeedback, SparseRow, scatter_mean
from .strategy import Strategy, register

__all__ = ["SELECT_PASSES", "TopK", "TopKOptions", "TopKPlan", "topk_select"]

#: Passes over the ``T`` float32 gradient entries of the selection (an assumption of the
#: job simulation at scale): error feedback ``acc = residual + g`` (read 2, write 1), a radix select
#: of the per-tensor threshold over ``|acc|`` (2 reads), and the residual update (1 write).  A
#: sort-based selection costs more (``log`` passes).
SELECT_PASSES = 6


def topk_select(acc, offsets, ks, out_idx) -> None:
    """Flat indices of the ``k_l`` largest ``|acc|`` in each tensor ``l``, into ``out_idx``.

    ``offsets[l]:offsets[l+1]`` is tensor ``l``'s range in the flat buffer; ``out_idx`` has
    ``Σ k_l`` slots filled tensor by tensor (order within a tensor is unspecified).
    """
    xp = array_module(acc)
    pos = 0
    for l, k in enumerate(ks):
        a, b = int(offsets[l]), int(offsets[l + 1])
        mag = xp.abs(acc[a:b])
        if k == b - a:
            sel = xp.arange(b - a)
        else:
            sel = xp.argpartition(mag, (b - a) - k)[(b - a) - k:]
        out_idx[pos:pos + k] = sel + a
        pos += k


@dataclass(frozen=True)
class TopKOptions:
    """Options of Top-K sparsification."""

    density: float = option(0.01, "fraction of each tensor's entries sent per step")
    error_feedback: bool = option(
        True, "accumulate unsent entries into the next step (disable with --no-error-feedback)")

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"--density must be in (0, 1] (e.g. 0.01 for 1 %), got "
                             f"{self.density}")


@dataclass(frozen=True)
class TopKPlan:
    """The one plan of Top-K: how many entries of each tensor every rank sends per step,
    ``k_l = min(n_l, max(1, ⌈d n_l⌉))`` (DGC's per-tensor selection), in backward order."""

    ks: tuple[int, ...]
    total: int

    @classmethod
    def for_layout(cls, layout, options: TopKOptions) -> TopKPlan:
        sizes = np.array([layout.sizes[n] for n in layout.names], dtype=np.int64)
        ks = np.minimum(sizes, np.maximum(1, np.ceil(options.density * sizes).astype(np.int64)))
        return cls(tuple(int(k) for k in ks), int(sizes.sum()))

    @property
    def K(self) -> int:
        return int(sum(self.ks))

    def select_kernels(self) -> int:
        """Kernel launches of ``topk_select`` (:func:`topk_select`, tensor by tensor): per
        tensor ``|acc|``, the ``argpartition``, the offset and the copy into the index buffer
        (4); once (:meth:`TopK._select`): the error feedback's accumulation, the gather of the
        sent values, values and indices into the row and the residual's update (6)."""
        return 4 * len(self.ks) + 6

    def calls(self, placement: Placement) -> list:
        """One step: the selection over every tensor after the whole backward (compute), one
        ring all-gather over all ranks of ``K`` float32 values + ``K`` int32 indices per rank,
        then the scatter-add of the ``p K`` gathered entries (compute).  The compute items
        (:class:`~substrate.calls.Work`) carry the bytes they stream: error feedback, the
        threshold and the residual (:data:`SELECT_PASSES` passes over the ``T`` float32
        entries), and the decode (the gathered pairs and the dense gradient)."""
        p, T, K = placement.size, self.total, self.K
        return [Work("topk_select", nbytes=SELECT_PASSES * 4 * T, after=(Ready(0, T),),
                     kernels=self.select_kernels()),
                Call("topk_allgather", "allgather", placement.world, blocks=(8 * K,) * p,
                     itemsize=4, after=(0,), label="topk_allgather"),
                Work("topk_decode", nbytes=p * 8 * K + 4 * T, after=(1,))]


@register
class TopK(Strategy):
    """Per-tensor Top-K with error feedback, all-gather of values and indices."""

    name = "topk"
    Options = TopKOptions

    def __init__(self, ctx, options: TopKOptions) -> None:
        super().__init__(ctx, options)
        xp, layout = self.xp, self.layout
        sizes = [layout.sizes[n] for n in layout.names]
        self.offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.plan = TopKPlan.for_layout(layout, options)
        self.ks, self.K = list(self.plan.ks), self.plan.K
        g = ctx.model.grads.flat
        if g.dtype != np.float32:
            raise ValueError(f"top-k packs float32 values with int32 indices; the model is "
                             f"{g.dtype} (build it with dtype float32)")
        if layout.total >= 2 ** 31:
            raise ValueError(f"{layout.total} parameters do not fit int32 indices")
        self.residual = xp.zeros_like(g)
        self._ef = ErrorFeedback(self.residual, options.error_feedback)
        self._idx = xp.empty(self.K, dtype=np.int64)
        self._row = SparseRow(0, self.K)             # [values as int32 bits | indices]
        self._send = self._row.empty(xp)
        self._gathered = None
        self._records = self.plan.calls(self.topo.placement)

    def records(self, state) -> list:
        return self._records

    def compute(self, label: str):
        return {"topk_select": self._select, "topk_decode": self._decode}[label]

    def buffer(self, call):
        return self._send

    def received(self, call, result) -> None:
        self._gathered = result

    def _decode(self) -> None:
        """Scatter the ``p K`` gathered entries into the gradient, averaged over the ranks."""
        g, row = self.ctx.model.grads.flat, self._row
        g[...] = scatter_mean(row.values(self._gathered), row.indices(self._gathered), g.size,
                              self.topo.size)
        self._gathered = None

    def _select(self) -> None:
        """Error feedback ``a = e + g`` and per-tensor Top-K of ``a`` into the send buffer
        ``[values | indices]`` (:class:`dataparallel.codec.SparseRow`); ``e = a - sparse(a)``."""
        acc = self._ef.accumulate(self.ctx.model.grads.flat)
        idx = self._idx
        topk_select(acc, self.offsets, self.ks, idx)
        self._row.put(self._send, 0, acc[idx], idx)
        self._ef.sent(idx)

    def report(self) -> dict:
        return {"payload_ratio": 2 * self.K / self.layout.total, "k_total": self.K}

    def state_dict(self) -> dict:
        """The error-feedback residual ``e``."""
        return {"residual": self.run.backend.asnumpy(self.residual).copy()}

    def load_state_dict(self, state: dict) -> None:
        self.residual[...] = self.xp.asarray(state["residual"])
