"""Multi-head self-attention (:class:`MultiHeadSelfAttention`; Vaswani et al. 2017, eqs. 1-2).

``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_h) + M) V`` per head, ``M`` ``-inf`` above the
diagonal when causal (GPT) and 0 when bidirectional (ViT, BERT);
``MultiHead(X) = Concat(head_1, ..., head_h) W^O`` with ``Q, K, V`` from one fused ``qkv``
projection.  On NumPy arrays with the Numba kernels loaded, attention runs chunk by chunk of
samples with a chunk's scores in cache (:data:`ATTN_CHUNK_BYTES`) and, when causal, queries in
blocks of :data:`ATTN_QUERY_BLOCK` so the blocks above the diagonal are never computed; the
softmax and its backward are :mod:`models.kernels_transformer`'s.
"""

from __future__ import annotations

import math

import numpy as np

from substrate.backend import array_module

from .im2col import Workspace
from .layer_base import Layer
from .layers import Linear
from .transformer_base import GPT2_INIT_STD, _kernels_for, _load_kernels, _thread_scratch

__all__ = ["ATTN_CHUNK_BYTES", "ATTN_QUERY_BLOCK", "MultiHeadSelfAttention"]

#: causal attention's query block (:meth:`MultiHeadSelfAttention._blocks`)
ATTN_QUERY_BLOCK = 64
#: bytes of attention scores per chunk of samples (cache-sized)
ATTN_CHUNK_BYTES = 1 << 18


class MultiHeadSelfAttention(Layer):
    """Multi-head self-attention (Vaswani et al. 2017, eqs. 1-2), causal or bidirectional.

    ``[Q K V] = x W_qkv^T + b_qkv`` split into ``heads`` heads of width ``d_h = dim / heads``;
    per head ``S = Q K^T / sqrt(d_h)`` (+ ``-inf`` above the diagonal when ``causal``),
    ``A = softmax(S)`` (row max subtracted), ``O = A V``; heads concatenated and projected by
    ``proj``.  Backward::

        dV = A^T dO,  dA = dO V^T,  dS = A ⊙ (dA - rowsum(dA ⊙ A)),
        dQ = dS K / sqrt(d_h),  dK = dS^T Q / sqrt(d_h)

    Children ``qkv`` (``Linear(dim, 3 dim)``) and ``proj`` (``Linear(dim, dim)``).
    """

    def __init__(self, dim: int, heads: int, causal: bool = False, bias: bool = True):
        super().__init__()
        if dim <= 0 or heads <= 0 or dim % heads:
            raise ValueError(f"attention width {dim} must be a positive multiple of heads={heads}")
        self.dim, self.heads, self.causal = int(dim), int(heads), bool(causal)
        self.head_dim = self.dim // self.heads
        self.qkv = self.add_child("qkv", Linear(dim, 3 * dim, bias=bias))
        self.proj = self.add_child("proj", Linear(dim, dim, bias=bias))
        self._ws = Workspace()
        self.qkv.init_std = {"weight": GPT2_INIT_STD}
        self.proj.init_std = {"weight": GPT2_INIT_STD}
        self.proj.residual_out = True

    def forward(self, x, training: bool = True):
        return self.forward_residual(x, training, proj_bias=True)

    def forward_residual(self, x, training: bool = True, proj_bias: bool = True):
        """The layer's output; without ``proj_bias`` the projection's bias is left for the
        caller to add (in its fused residual pass; :meth:`backward_residual` then takes its
        gradient)."""
        if x.ndim != 3 or x.shape[2] != self.dim:
            raise ValueError(f"attention expects (N, T, {self.dim}), got {tuple(x.shape)}")
        N, T, d = x.shape
        h, dh = self.heads, self.head_dim
        qkv = self.qkv.forward(x.reshape(N * T, d)).reshape(N, T, 3, h, dh)
        k = _kernels_for(x)
        if k is not None:
            o = self._core_forward(k, qkv)
        else:
            o = self._core_forward_xp(qkv)
        o2 = o.reshape(N * T, d)
        y = self.proj.forward(o2) if proj_bias else self.proj.forward_nobias(o2)
        return y.reshape(N, T, d)

    def _core_forward_xp(self, qkv):
        """Array path (CuPy, no Numba): whole ``(N, h, T, T)`` score arrays."""
        xp = array_module(qkv)
        _N, T, _, _h, dh = qkv.shape
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (N, h, T, dh)
        scale = 1.0 / math.sqrt(dh)
        s = (q @ k.transpose(0, 1, 3, 2)) * scale
        if self.causal:
            s = xp.where(xp.tril(xp.ones((T, T), dtype=bool)), s, -xp.inf)
        s -= s.max(axis=-1, keepdims=True)
        a = xp.exp(s)
        a /= a.sum(axis=-1, keepdims=True)
        o = a @ v
        self._cache = ("xp", q, k, v, a)
        return o.transpose(0, 2, 1, 3)

    # -- Numba path: blocks of samples (and of queries), scores in cache ----------------------
    def _blocks(self, N: int, T: int):
        """``(samples per chunk, [(i0, i1), ...] query blocks)``.  Causal attention takes
        queries in blocks of :data:`ATTN_QUERY_BLOCK`; block ``[i0, i1)`` sees keys
        ``[0, i1)``, so the score blocks above the diagonal are never computed (at T = 256,
        62.5 % of the full products).  A chunk's scores take about :data:`ATTN_CHUNK_BYTES`."""
        qb = ATTN_QUERY_BLOCK if self.causal and T > ATTN_QUERY_BLOCK else T
        blocks = [(i0, min(T, i0 + qb)) for i0 in range(0, T, qb)]
        per_sample = self.heads * qb * T * 4
        return max(1, min(N, ATTN_CHUNK_BYTES // per_sample)), blocks

    def _core_forward(self, k, qkv):
        """``softmax(Q K^T / sqrt(d_h) + M) V`` chunk by chunk: per query block one batched
        GEMM for the scores (written into the kept probability array), the row maximum, shift
        and scale in Numba, ``exp`` in NumPy, the row normalization in Numba, one batched GEMM
        for ``A V`` into the output; chunks shared over the threads."""
        N, T, _, h, dh = qkv.shape
        q = qkv[:, :, 0].transpose(0, 2, 1, 3)               # (N, h, T, dh) views
        kt = qkv[:, :, 1].transpose(0, 2, 3, 1)              # (N, h, dh, T)
        v = qkv[:, :, 2].transpose(0, 2, 1, 3)
        o = np.empty((N, T, h, dh), dtype=qkv.dtype)
        ov = o.transpose(0, 2, 1, 3)
        probs = self._ws.get("probs", (N, h, T, T), qkv.dtype, np)
        per, blocks = self._blocks(N, T)
        scale = qkv.dtype.type(1.0 / math.sqrt(dh))
        causal = self.causal

        def chunks(lo, hi):
            for c in range(lo, hi):
                n0, n1 = c * per, min(N, (c + 1) * per)
                for i0, i1 in blocks:
                    L = i1 if causal else T
                    a = probs[n0:n1, :, i0:i1, :L]
                    np.matmul(q[n0:n1, :, i0:i1], kt[n0:n1, :, :, :L], out=a)
                    k.softmax_shift(probs, n0, n1, i0, i1, L, scale, causal)
                    np.exp(a, out=a)
                    k.softmax_normalize(probs, n0, n1, i0, i1, L)
                    np.matmul(a, v[n0:n1, :, :L], out=ov[n0:n1, :, i0:i1])

        with k.blas_on_one_thread():
            k.parallel_for(chunks, -(-N // per), 2 * N * h * T * T)
        self._cache = ("rows", probs, o, per, blocks, qkv)
        return o

    def backward(self, dy):
        return self.backward_residual(dy)

    def backward_residual(self, dy, proj_bias_grad=None):
        """Input gradient; ``proj_bias_grad`` is the projection's bias gradient when the
        forward left the bias to the caller (``Σ_rows dy``, summed by the caller's pass)."""
        N, T, d = dy.shape
        h, dh = self.heads, self.head_dim
        dy2 = dy.reshape(N * T, d)
        if proj_bias_grad is None:
            do = self.proj.backward(dy2)
        else:
            do = self.proj.backward_with_bias_grad(dy2, proj_bias_grad)
        do = do.reshape(N, T, h, dh)
        if self._cache[0] == "rows":
            dqkv = self._core_backward(_load_kernels(), do)
        else:
            dqkv = self._core_backward_xp(do)
        self._cache = None
        return self.qkv.backward(dqkv.reshape(N * T, 3 * d)).reshape(N, T, d)

    def _core_backward_xp(self, do):
        xp = array_module(do)
        _, q, k, v, a = self._cache
        N, T, h, dh = do.shape
        scale = 1.0 / math.sqrt(dh)
        do = do.transpose(0, 2, 1, 3)
        dqkv = xp.empty((N, T, 3, h, dh), dtype=do.dtype)
        dqkv[:, :, 2] = (a.transpose(0, 1, 3, 2) @ do).transpose(0, 2, 1, 3)
        da = do @ v.transpose(0, 1, 3, 2)
        ds = a * (da - (da * a).sum(axis=-1, keepdims=True))
        ds *= scale
        dqkv[:, :, 0] = (ds @ k).transpose(0, 2, 1, 3)
        dqkv[:, :, 1] = (ds.transpose(0, 1, 3, 2) @ q).transpose(0, 2, 1, 3)
        return dqkv

    def _core_backward(self, k, do):
        """``dV = A^T dO``, ``dS = A ⊙ (dO V^T - rowsum(dO ⊙ O)) / sqrt(d_h)``, ``dQ = dS K``,
        ``dK = dS^T Q``, chunk by chunk: ``dV`` and ``dK`` by key blocks (keys ``[j0, j1)`` are
        seen by queries ``[j0, T)``, or all queries when not causal: one GEMM each, nothing to
        accumulate), ``dS`` (written over the kept probabilities) and ``dQ`` by query blocks;
        chunks shared over the threads."""
        _, probs, o, per, blocks, qkv = self._cache
        N, T, h, dh = do.shape
        q, kk, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        dqkv = np.empty((N, T, 3, h, dh), dtype=do.dtype)
        dq, dk, dv = (dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        do = np.ascontiguousarray(do)
        dov = do.transpose(0, 2, 1, 3)
        scale = do.dtype.type(1.0 / math.sqrt(dh))
        causal = self.causal

        def chunks(lo, hi):
            for c in range(lo, hi):
                n0, n1 = c * per, min(N, (c + 1) * per)
                p = probs[n0:n1]
                for j0, j1 in blocks:                   # dV = A^T dO by key blocks
                    q0 = j0 if causal else 0
                    np.matmul(p[:, :, q0:, j0:j1].transpose(0, 1, 3, 2), dov[n0:n1, :, q0:],
                              out=dv[n0:n1, :, j0:j1])
                for i0, i1 in blocks:                   # dS over A, dQ = dS K by query blocks
                    L = i1 if causal else T
                    da = _thread_scratch("attn_da", (n1 - n0, h, i1 - i0, L), do.dtype)
                    np.matmul(dov[n0:n1, :, i0:i1], v[n0:n1, :, :L].transpose(0, 1, 3, 2),
                              out=da)
                    k.softmax_backward(probs, da, do, o, n0, n1, i0, i1, L, scale, causal)
                    np.matmul(p[:, :, i0:i1, :L], kk[n0:n1, :, :L], out=dq[n0:n1, :, i0:i1])
                for j0, j1 in blocks:                   # dK = dS^T Q by key blocks
                    q0 = j0 if causal else 0
                    np.matmul(p[:, :, q0:, j0:j1].transpose(0, 1, 3, 2), q[n0:n1, :, q0:],
                              out=dk[n0:n1, :, j0:j1])

        with k.blas_on_one_thread():
            k.parallel_for(chunks, -(-N // per), 4 * N * h * T * T)
        return dqkv

    def output_shape(self, in_shape):
        return tuple(in_shape)

    def macs(self, in_shape):
        T = in_shape[0]
        return T * (self.qkv.macs(()) + self.proj.macs(())) + 2 * T * T * self.dim

    def __repr__(self):
        return (f"MultiHeadSelfAttention({self.dim}, heads={self.heads}, causal={self.causal}, "
                f"bias={self.qkv.bias})")
