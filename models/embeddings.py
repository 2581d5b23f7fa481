"""Embedding layers of the transformers: tokens, positions, segments, the class token, patches.

* :class:`Embedding`: a token table ``E[x]`` (optionally tied to an
  :class:`~models.transformer.LMHead`, GPT-2's weight tying);
* :class:`PositionEmbedding`: learned absolute positions added to ``(N, T, d)``;
* :class:`SegmentEmbedding`: BERT's token types (Devlin et al. 2019, §3.2);
* :class:`ClassToken`: ViT's ``[class]`` token prepended to the sequence;
* :class:`PatchEmbedding`: ViT's linear patch projection (Dosovitskiy et al. 2021, eq. 1:
  ``z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos``).

Same conventions as :mod:`models.layers`; the token embedding's gradient is threaded by the
Numba kernels once loaded.
"""

from __future__ import annotations

import numpy as np

from substrate.backend import array_module

from .layer_base import Layer
from .layers import Linear
from .transformer_base import GPT2_INIT_STD, _as_tokens, _kernels_for, _rows2d, _scatter_add_rows

__all__ = ["ClassToken", "Embedding", "PatchEmbedding", "PositionEmbedding", "SegmentEmbedding"]


class Embedding(Layer):
    """Token embedding ``E[t]``: ``(N, T)`` integer ids -> ``(N, T, dim)``.

    Parameter ``weight`` (kind ``"fc"``, shape ``(num_embeddings, dim)``, init ``N(0, 0.02)``).
    Backward scatters ``dy`` into the rows that were looked up (repeated ids summed) and returns
    ``None`` (token ids have no gradient).  When an :class:`LMHead` is tied to this table, the
    head's contribution is added here, so the table's gradient is ready once, after both.
    """

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        if num_embeddings <= 0 or dim <= 0:
            raise ValueError(f"Embedding needs positive sizes, got {num_embeddings}, {dim}")
        self.num_embeddings, self.dim = int(num_embeddings), int(dim)
        self.declare_param("weight", "fc", (num_embeddings, dim), "he")
        self.init_std = {"weight": GPT2_INIT_STD}
        self._tied_grad = None

    def forward(self, x, training: bool = True):
        x = _as_tokens(x, self.num_embeddings, "Embedding")
        self._idx = x
        return self.P["weight"][x]

    def backward(self, dy):
        g = self.G["weight"]
        k = _kernels_for(dy)
        if k is not None and g.flags.c_contiguous:      # threaded, the bits of np.add.at
            k.embedding_grad(g, np.ascontiguousarray(self._idx.reshape(-1)), _rows2d(dy))
        else:
            g.fill(0)
            _scatter_add_rows(g, self._idx.reshape(-1), dy.reshape(-1, self.dim))
        if self._tied_grad is not None:
            g += self._tied_grad
            self._tied_grad = None
        self._emit_ready()
        self._idx = None

    def output_shape(self, in_shape):
        return (*in_shape, self.dim)

    def __repr__(self):
        return f"Embedding({self.num_embeddings}, {self.dim})"


class PositionEmbedding(Layer):
    """Learned absolute positions: ``y[:, t] = x[:, t] + P[t]`` for ``t < T <= max_len``.

    Parameter ``weight`` (kind ``"fc"``, shape ``(max_len, dim)``, init ``N(0, 0.02)``); rows
    ``>= T`` get zero gradient.
    """

    def __init__(self, max_len: int, dim: int):
        super().__init__()
        if max_len <= 0 or dim <= 0:
            raise ValueError(f"PositionEmbedding needs positive sizes, got {max_len}, {dim}")
        self.max_len, self.dim = int(max_len), int(dim)
        self.declare_param("weight", "fc", (max_len, dim), "he")
        self.init_std = {"weight": GPT2_INIT_STD}

    def forward(self, x, training: bool = True):
        T = x.shape[1]
        if x.ndim != 3 or x.shape[2] != self.dim or T > self.max_len:
            raise ValueError(f"PositionEmbedding expects (N, T <= {self.max_len}, {self.dim}), "
                             f"got {tuple(x.shape)}")
        self._T = T
        return x + self.P["weight"][:T]

    def backward(self, dy):
        g = self.G["weight"]
        g[:self._T] = dy.sum(axis=0)
        g[self._T:] = 0
        self._emit_ready()
        return dy

    def output_shape(self, in_shape):
        T, d = in_shape
        if d != self.dim or T > self.max_len:
            raise ValueError(f"PositionEmbedding expects (T <= {self.max_len}, {self.dim}), got "
                             f"{in_shape}")
        return tuple(in_shape)

    def __repr__(self):
        return f"PositionEmbedding({self.max_len}, {self.dim})"


class SegmentEmbedding(Layer):
    """BERT's token-type embedding for single-segment input: ``y = x + S[0]``.

    Parameter ``weight`` (kind ``"fc"``, shape ``(num_types, dim)``); only row 0 is used (and
    gets gradient) because inputs here are one segment.
    """

    def __init__(self, num_types: int, dim: int):
        super().__init__()
        self.num_types, self.dim = int(num_types), int(dim)
        self.declare_param("weight", "fc", (num_types, dim), "he")
        self.init_std = {"weight": GPT2_INIT_STD}

    def forward(self, x, training: bool = True):
        return x + self.P["weight"][0]

    def backward(self, dy):
        g = self.G["weight"]
        g.fill(0)
        g[0] = dy.sum(axis=tuple(range(dy.ndim - 1)))
        self._emit_ready()
        return dy

    def __repr__(self):
        return f"SegmentEmbedding({self.num_types}, {self.dim})"


class ClassToken(Layer):
    """Prepend a learned ``[class]`` vector: ``(N, T, d) -> (N, T + 1, d)`` (ViT eq. 1).

    Parameter ``weight`` (kind ``"bias"``, shape ``(dim,)``, init ``N(0, 0.02)``).
    """

    def __init__(self, dim: int):
        super().__init__()
        self.dim = int(dim)
        self.declare_param("weight", "bias", (dim,), "he")
        self.init_std = {"weight": GPT2_INIT_STD}

    def forward(self, x, training: bool = True):
        xp = array_module(x)
        N, T, d = x.shape
        out = xp.empty((N, T + 1, d), dtype=x.dtype)
        out[:, 0] = self.P["weight"]
        out[:, 1:] = x
        return out

    def backward(self, dy):
        self.G["weight"][...] = dy[:, 0].sum(axis=0)
        self._emit_ready()
        return dy[:, 1:]

    def output_shape(self, in_shape):
        T, d = in_shape
        return (T + 1, d)

    def __repr__(self):
        return f"ClassToken({self.dim})"


class PatchEmbedding(Layer):
    """Split ``(N, C, H, W)`` images into ``p x p`` patches and project them linearly.

    Patch ``(i, j)`` becomes token ``i * (W / p) + j``; its ``C p p`` values are flattened in
    ``(c, di, dj)`` order (the order of a ``Conv2d(C, dim, p, stride=p)`` weight, so the child
    ``proj`` is that convolution written as a :class:`~models.layers.Linear`).

    Parameters
    ----------
    in_shape : (C, H, W)
    patch : int
        Patch side; must divide ``H`` and ``W``.
    dim : int
    """

    def __init__(self, in_shape, patch: int, dim: int):
        super().__init__()
        C, H, W = (int(s) for s in in_shape)
        p = int(patch)
        if p < 1 or H % p or W % p:
            raise ValueError(f"patch size {p} must divide the image size {(H, W)}; pick a "
                             f"divisor, e.g. --arch patch=2 for 8x8 digits")
        self.in_shape, self.patch, self.dim = (C, H, W), p, int(dim)
        self.grid = (H // p, W // p)
        self.proj = self.add_child("proj", Linear(C * p * p, dim))
        self.proj.init_std = {"weight": GPT2_INIT_STD}

    def forward(self, x, training: bool = True):
        C, H, W = self.in_shape
        if tuple(x.shape[1:]) != self.in_shape:
            raise ValueError(f"PatchEmbedding expects (N, {C}, {H}, {W}), got {tuple(x.shape)}")
        N, p, (gh, gw) = x.shape[0], self.patch, self.grid
        cols = x.reshape(N, C, gh, p, gw, p).transpose(0, 2, 4, 1, 3, 5)
        y = self.proj.forward(cols.reshape(N * gh * gw, C * p * p))
        return y.reshape(N, gh * gw, self.dim)

    def backward(self, dy):
        C, H, W = self.in_shape
        N, p, (gh, gw) = dy.shape[0], self.patch, self.grid
        dcols = self.proj.backward(dy.reshape(N * gh * gw, self.dim))
        dx = dcols.reshape(N, gh, gw, C, p, p).transpose(0, 3, 1, 4, 2, 5)
        return dx.reshape(N, C, H, W)

    def output_shape(self, in_shape):
        if tuple(in_shape) != self.in_shape:
            raise ValueError(f"PatchEmbedding built for {self.in_shape}, got {in_shape}")
        return (self.grid[0] * self.grid[1], self.dim)

    def macs(self, in_shape):
        return self.grid[0] * self.grid[1] * self.proj.macs((self.proj.in_features,))

    def __repr__(self):
        return f"PatchEmbedding({self.in_shape}, patch={self.patch}, dim={self.dim})"
