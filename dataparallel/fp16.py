"""FP16 all-reduce: the quantization baseline PacTrain compares against (paper 002 §IV-C,
"FP16 quantization"; PyTorch DDP's ``fp16_compress_hook``).

Every step each of DDP's gradient buckets (:func:`dataparallel.ddp.flat_buckets`, whole tensors
of at most ``--bucket-mib`` float32 bytes) is cast to half precision and divided by the world
size ``p`` in half precision, summed by one ring all-reduce of the half-precision values
(``fp16_allreduce``) and cast back::

    g_b ← float32( Σ_j fp16( fp16(g_{j,b}) / p ) )        (sums rounded to fp16 on the ring)

as the hook does (``buffer.to(float16).div_(world_size)``, all-reduce SUM, ``copy_`` back), so
the wire carries 2 bytes per entry, half of DDP's.  Closed form: :mod:`volume.fp16`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from substrate.calls import Call, Placement, Ready
from substrate.options import option

from .ddp import flat_buckets
from .strategy import Strategy, register

#: bytes of one half-precision value on the wire
FP16_ITEMSIZE = np.dtype(np.float16).itemsize

__all__ = ["FP16", "FP16_ITEMSIZE", "FP16Options", "FP16Plan"]


@dataclass(frozen=True)
class FP16Options:
    """Options of the FP16 all-reduce."""

    bucket_mib: float = option(32.0, "gradient bucket size in MiB")

    def __post_init__(self) -> None:
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")


@dataclass(frozen=True)
class FP16Plan:
    """DDP's buckets (whole float32 tensors of at most ``--bucket-mib``), each all-reduced as
    half-precision values, in order after the backward."""

    buckets: tuple[tuple[int, int], ...]

    @classmethod
    def for_layout(cls, layout, options: FP16Options, itemsize: int = 4) -> FP16Plan:
        return cls(tuple(flat_buckets(layout, int(options.bucket_mib * (1 << 20)), itemsize)))

    def calls(self, placement: Placement) -> list[Call]:
        """One step: per bucket a ring all-reduce (SUM) of its fp16 values over all ranks, the
        first after the whole backward, each after the previous."""
        out: list[Call] = []
        total = self.buckets[-1][1] if self.buckets else 0
        for k, (a, b) in enumerate(self.buckets):
            after = (len(out) - 1,) if out else (Ready(0, total),)
            out.append(Call("fp16_allreduce", "allreduce", placement.world,
                            (b - a) * FP16_ITEMSIZE, FP16_ITEMSIZE, op="sum", after=after,
                            label=f"fp16_allreduce[{k}]"))
        return out


@register
class FP16(Strategy):
    """Average every gradient bucket in half precision (see the module docstring): the codec
    of each :meth:`FP16Plan.calls` record rounds its bucket to fp16 and divides it by ``p``
    (encode) and casts the sum back into the bucket (decode)."""

    name = "fp16"
    Options = FP16Options

    def __init__(self, ctx, options: FP16Options) -> None:
        super().__init__(ctx, options)
        g = ctx.model.grads.flat
        self.plan = FP16Plan.for_layout(self.layout, options, g.dtype.itemsize)
        self.buckets = self.plan.buckets
        self._records = self.plan.calls(self.topo.placement)
        half = [self.xp.empty(b - a, dtype=np.float16) for a, b in self.buckets]
        self._codec = {c.label: (g[a:b], h) for c, (a, b), h in
                       zip(self._records, self.buckets, half)}

    def records(self, state) -> list[Call]:
        return self._records

    def buffer(self, call: Call):
        g, h = self._codec[call.label]
        h[...] = g                               # round to fp16
        h /= np.float16(self.topo.size)          # divide in fp16, as the hook does
        return h

    def received(self, call: Call, result) -> None:
        g, h = self._codec[call.label]
        g[...] = h

    def report(self) -> dict:
        return {"payload_ratio": FP16_ITEMSIZE / self.ctx.model.grads.flat.dtype.itemsize,
                "buckets": len(self.buckets)}
