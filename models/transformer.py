"""Transformer layers with hand-written backward, on NumPy or CuPy, and the models built from them.

Layers (same conventions as :mod:`models.layers`: a layer *declares* its parameters, the
:class:`~models.network.Model` binds views into one flat parameter and one flat gradient vector,
``backward`` *writes* the parameter gradients and returns the input gradient):

* :class:`Embedding` (token table, optionally tied to an :class:`LMHead`),
  :class:`PositionEmbedding` (learned absolute positions), :class:`SegmentEmbedding` (BERT's
  token types), :class:`ClassToken` (ViT's ``[class]`` token), :class:`PatchEmbedding` (ViT,
  Dosovitskiy et al. 2021, eq. 1: ``z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos``);
* :class:`MultiHeadSelfAttention`, causal or bidirectional:
  ``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_h) + M) V`` per head (Vaswani et al. 2017,
  eq. 1; ``M`` is ``-inf`` above the diagonal when causal);
* :class:`LayerNorm` (Ba et al. 2016), :class:`RMSNorm` (LLaMA), :class:`GELU` (tanh form of
  Hendrycks & Gimpel, as GPT-2 and BERT use it), :class:`Tanh`, :class:`MLP`
  (``fc2(GELU(fc1 x))``), :class:`SwiGLU` (LLaMA: ``w2(silu(w1 x) * w3 x)``);
* :class:`TransformerBlock`: pre-norm (GPT-2, ViT, LLaMA:
  ``h = x + Attn(LN1 x)``, ``y = h + MLP(LN2 h)``) or post-norm (BERT:
  ``h = LN1(x + Attn x)``, ``y = LN2(h + MLP h)``);
* :class:`TokenPool` (class token / mean / last position), :class:`LMHead` (per-position logits).

Softmax and LayerNorm are computed in the dtype of the model (float32 by default) in their stable
forms: the row maximum is subtracted before ``exp``, and the variance is the mean of squared
*centered* values (never ``E[x^2] - E[x]^2``).

On NumPy arrays the layers load the Numba kernels (:mod:`models.kernels`) and take fused paths
(the same values to float round-off; CuPy keeps the array path): LayerNorm in one pass per row
(statistics in float64), a pre-norm block's residual sum ``h = x + (attention + proj bias)``
formed in ``ln2``'s pass and its backward's ``dh = dy + ln2'(...)`` with the projection's bias
gradient summed in the same pass; GELU with ``fc1``'s bias; attention chunk by chunk of
samples with the scores of a chunk in cache and, when causal, queries in blocks of
:data:`ATTN_QUERY_BLOCK` so the blocks above the diagonal are never computed; the embedding's
scatter-add threaded.  GEMMs run through :func:`models.kernels.matmul`.

Models: :func:`vit` (a small ViT for the 8x8 digits: 2x2 patches) and :func:`gpt` (a small
GPT-2-style decoder over bytes).  Both are :class:`TransformerModel` (a :class:`Model` subclass)
that initializes like GPT-2 (``N(0, 0.02)`` weights, residual projections scaled by
``1/sqrt(2 L)``, LayerNorm ``(1, 0)``, zero biases) and accepts integer token input.  A language
model's per-sample input is a window of ``T`` byte tokens and its label the byte after the window
(:mod:`models.text`): :meth:`TransformerModel.forward` returns the logits of the *last* position
(so accuracy/loss code written for classifiers reads "next-byte prediction"), while
:meth:`TransformerModel.loss_and_grad` trains on *every* position (targets are the window shifted
by one, completed by the label), the usual causal-LM loss.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from substrate.backend import array_module

from .data import iterate_batches
from .im2col import Workspace
from .kernel_loader import kernels as _load_kernels
from .layers import Layer, Linear, Sequential, _matmul, softmax_cross_entropy
from .modelspec import ModelSpec, layer_tree_specs
from .network import Model

__all__ = [
    "Embedding", "PositionEmbedding", "SegmentEmbedding", "ClassToken", "PatchEmbedding",
    "LayerNorm", "RMSNorm", "GELU", "Tanh", "MultiHeadSelfAttention", "MLP", "SwiGLU",
    "TransformerBlock", "TokenPool", "LMHead", "TransformerModel", "vit_layers", "gpt_layers",
    "bert_layers", "llama_layers", "vit", "gpt", "GPT2_INIT_STD",
]

#: standard deviation of GPT-2's weight initializer
GPT2_INIT_STD = 0.02
#: causal attention's query block (:meth:`MultiHeadSelfAttention._blocks`)
ATTN_QUERY_BLOCK = 64
#: bytes of attention scores per chunk of samples (cache-sized)
ATTN_CHUNK_BYTES = 1 << 18


def _kernels_for(x):
    """The Numba kernels (:mod:`models.kernels`, imported on first use) for a NumPy float
    array, else ``None`` (CuPy arrays, integer input, or no Numba): the layers then take their
    array path, the same values to float round-off."""
    if x.dtype.kind != "f" or array_module(x) is not np:
        return None
    return _load_kernels()


_LOCAL = threading.local()


def _thread_scratch(key: str, shape, dtype):
    """A scratch array private to the calling thread (one per key, shape and dtype), for the
    passes that :func:`models.kernels.parallel_for` shares over threads."""
    ws = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = Workspace()
    shape = tuple(int(n) for n in shape)
    return ws.get((key, shape, np.dtype(dtype).str), shape, dtype, np)


def _rows2d(x):
    """``x`` as a C-contiguous ``(rows, last dim)`` matrix (a view when it already is one)."""
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]))


def _scatter_add_rows(out, idx, rows) -> None:
    """``out[idx[i]] += rows[i]`` with repeated indices summed (NumPy ``add.at`` / CuPy)."""
    xp = array_module(out)
    if xp is np:
        np.add.at(out, idx, rows)
    else:  # pragma: no cover - GPU only
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(out, idx, rows)


def _as_tokens(x, vocab: int, what: str):
    xp = array_module(x)
    if x.dtype.kind == "f":
        t = x.astype(xp.int64)
        if not bool((t == x).all()):
            raise ValueError(f"{what} expects integer token ids, got non-integer floats")
        x = t
    elif x.dtype.kind not in "iu":
        raise ValueError(f"{what} expects integer token ids, got dtype {x.dtype}")
    if x.size and (int(x.min()) < 0 or int(x.max()) >= vocab):
        raise ValueError(f"{what}: token ids must be in [0, {vocab}), got range "
                         f"[{int(x.min())}, {int(x.max())}]")
    return x


# ---------------------------------------------------------------------------------------------
# embeddings
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# normalization and activations (last axis, any leading shape)
# ---------------------------------------------------------------------------------------------
class LayerNorm(Layer):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the last axis (Ba et al. 2016).

    Parameters ``weight`` (gamma, ones) and ``bias`` (beta, zeros), kind ``"bn"``.  The variance
    is the biased mean of squared centered values.  Backward, with ``x̂`` the normalized input,
    ``g = dy * gamma`` and ``D`` the width::

        dx = rstd / D * (D g - sum(g) - x̂ sum(g x̂)),   dgamma = Σ dy x̂,   dbeta = Σ dy
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        if dim <= 0 or not eps > 0:
            raise ValueError(f"LayerNorm needs dim > 0 and eps > 0, got {dim}, {eps}")
        self.dim, self.eps = int(dim), float(eps)
        self.declare_param("weight", "bn", (dim,), "ones")
        self.declare_param("bias", "bn", (dim,), "zeros")

    def forward(self, x, training: bool = True):
        if x.shape[-1] != self.dim:
            raise ValueError(f"LayerNorm expects last dim {self.dim}, got {tuple(x.shape)}")
        k = _kernels_for(x)
        if k is not None:
            return self._forward_rows(k, x)[1]
        xp = array_module(x)
        xc = x - x.mean(axis=-1, keepdims=True)
        var = (xc * xc).mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt(var + self.eps)
        x_hat = xc * rstd
        self._cache = ("xp", x_hat, rstd)
        return x_hat * self.P["weight"] + self.P["bias"]

    def _forward_rows(self, k, x, r=None, b=None):
        """Numba path: one pass per row (statistics in float64); with ``r`` the residual sum
        ``h = x + (r + b)`` is formed in the same pass and normalized.  Returns ``(h, y)``."""
        X = _rows2d(x)
        M = X.shape[0]
        Y = np.empty_like(X)
        mean, rstd = np.empty(M), np.empty(M)
        if r is None:
            H = X
            k.layer_norm_forward(X, self.P["weight"], self.P["bias"], self.eps, Y, mean, rstd)
        else:
            H = np.empty_like(X)
            k.layer_norm_forward(X, self.P["weight"], self.P["bias"], self.eps, Y, mean, rstd,
                                 R=_rows2d(r), B=b, H=H)
        self._cache = ("rows", H, mean, rstd)
        return H.reshape(x.shape), Y.reshape(x.shape)

    def forward_residual(self, x, r, b=None):
        """``h = x + (r + b)`` (a residual sum; ``b`` a bias row or ``None``) and ``LN(h)``, in
        one pass with the Numba kernels; returns ``(h, LN(h))``."""
        k = _kernels_for(x)
        if k is not None and r.shape == x.shape:
            return self._forward_rows(k, x, r, b)
        h = x + (r if b is None else r + b)
        return h, self.forward(h)

    def backward(self, dy):
        return self.backward_residual(dy)[0]

    def backward_residual(self, dy, dres=None, colsum: bool = False):
        """Input gradient plus the residual stream's gradient ``dres`` (``dres + dx``, one
        pass with the Numba kernels), and with ``colsum`` its sum over rows (the bias
        gradient of the layer whose output fed the residual sum); returns ``(dx, sum or
        None)``."""
        if self._cache[0] == "rows":
            _, X, mean, rstd = self._cache
            k = _load_kernels()
            dY = _rows2d(dy)
            dX = np.empty_like(dY)
            dg, db, cs = k.layer_norm_backward(dY, X, mean, rstd, self.P["weight"], dX,
                                               R=None if dres is None else _rows2d(dres),
                                               colsum=colsum)
            self.G["weight"][...] = dg
            self.G["bias"][...] = db
            self._emit_ready()
            self._cache = None
            return dX.reshape(dy.shape), (None if cs is None else cs.astype(dy.dtype))
        _, x_hat, rstd = self._cache
        lead = tuple(range(dy.ndim - 1))
        self.G["weight"][...] = (dy * x_hat).sum(axis=lead)
        self.G["bias"][...] = dy.sum(axis=lead)
        self._emit_ready()
        g = dy * self.P["weight"]
        D = self.dim
        dx = rstd / D * (D * g - g.sum(axis=-1, keepdims=True)
                         - x_hat * (g * x_hat).sum(axis=-1, keepdims=True))
        self._cache = None
        if dres is not None:
            dx = dres + dx
        return dx, (dx.reshape(-1, D).sum(axis=0) if colsum else None)

    def __repr__(self):
        return f"LayerNorm({self.dim}, eps={self.eps})"


class RMSNorm(Layer):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` over the last axis (LLaMA; Zhang & Sennrich 2019).

    Parameter ``weight`` (gamma, ones, kind ``"bn"``).  Backward with ``g = dy * gamma``:
    ``dx = rstd (g - x̂ mean(g x̂))``.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = int(dim), float(eps)
        self.declare_param("weight", "bn", (dim,), "ones")

    def forward(self, x, training: bool = True):
        xp = array_module(x)
        rstd = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps)
        x_hat = x * rstd
        self._cache = (x_hat, rstd)
        return x_hat * self.P["weight"]

    def backward(self, dy):
        x_hat, rstd = self._cache
        self.G["weight"][...] = (dy * x_hat).sum(axis=tuple(range(dy.ndim - 1)))
        self._emit_ready()
        g = dy * self.P["weight"]
        self._cache = None
        return rstd * (g - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))

    def __repr__(self):
        return f"RMSNorm({self.dim}, eps={self.eps})"


_GELU_C = math.sqrt(2.0 / math.pi)


class GELU(Layer):
    """``y = x/2 (1 + tanh(c (x + 0.044715 x^3)))``, ``c = sqrt(2/pi)`` (GPT-2 / BERT form)."""

    def forward(self, x, training: bool = True):
        return self.forward_bias(x)

    def forward_bias(self, z, b=None):
        """GELU of ``z + b`` (``b`` a bias row or ``None``): with the Numba kernels, the bias
        sum, the polynomial and the output in Numba around NumPy's vectorised ``tanh``, block
        by block of rows (the same float32 operations, so the same values as the array path);
        ``z`` may be overwritten with ``z + b``."""
        k = _kernels_for(z)
        if k is not None:
            Z = _rows2d(z)
            T, Y = np.empty_like(Z), np.empty_like(Z)
            k.gelu_forward(Z, b, Z, T, Y)
            self._cache = ("rows", Z, T)
            return Y.reshape(z.shape)
        x = z if b is None else z + b
        xp = array_module(x)
        t = xp.tanh(_GELU_C * (x + 0.044715 * x * x * x))
        self._cache = ("xp", x, t)
        return 0.5 * x * (1.0 + t)

    def backward(self, dy):
        return self.backward_bias(dy)[0]

    def backward_bias(self, dy, bias_grad: bool = False):
        """``dL/dz`` and, with ``bias_grad``, ``Σ_rows dL/dz`` (the gradient of the bias added
        in :meth:`forward_bias`, summed in the same pass); returns ``(dz, sum or None)``."""
        kind, x, t = self._cache
        self._cache = None
        if kind == "rows":
            k = _load_kernels()
            dY = _rows2d(dy)
            dZ = np.empty_like(dY)
            db = k.gelu_backward(dY, x, t, dZ, colsum=bias_grad)
            return dZ.reshape(dy.shape), (None if db is None else db.astype(dy.dtype))
        du = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        dz = dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
        return dz, (dz.reshape(-1, dz.shape[-1]).sum(axis=0) if bias_grad else None)


class Tanh(Layer):
    """``y = tanh(x)`` (BERT's pooler)."""

    def forward(self, x, training: bool = True):
        self._y = array_module(x).tanh(x)
        return self._y

    def backward(self, dy):
        y, self._y = self._y, None
        return dy * (1.0 - y * y)


# ---------------------------------------------------------------------------------------------
# attention and MLP blocks on (N, T, d)
# ---------------------------------------------------------------------------------------------
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
        N, T, _, h, dh = qkv.shape
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


class _Tokenwise(Layer):
    """Children applied to ``(N, T, d)`` as ``(N T, d)`` rows (or to ``(N, d)`` directly)."""

    def _run(self, x, training):
        self._shape = x.shape
        h = x.reshape(-1, x.shape[-1])
        for _, layer in self._children:
            h = layer.forward(h, training)
        return h.reshape(*x.shape[:-1], h.shape[-1])

    def _back(self, dy):
        d = dy.reshape(-1, dy.shape[-1])
        for _, layer in reversed(self._children):
            d = layer.backward(d)
        return d.reshape(self._shape)


class MLP(_Tokenwise):
    """Position-wise feed-forward block ``fc2(GELU(fc1 x))``: children ``fc1``, ``act``,
    ``fc2``."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.dim, self.hidden = int(dim), int(hidden)
        self.fc1 = self.add_child("fc1", Linear(dim, hidden, bias=bias))
        self.add_child("act", GELU())
        self.fc2 = self.add_child("fc2", Linear(hidden, dim, bias=bias))
        self.fc1.init_std = {"weight": GPT2_INIT_STD}
        self.fc2.init_std = {"weight": GPT2_INIT_STD}
        self.fc2.residual_out = True

    def forward(self, x, training: bool = True):
        if _kernels_for(x) is None:
            return self._run(x, training)
        # fc1's bias is added in GELU's first pass, its gradient summed in GELU's backward
        self._shape = x.shape
        z = self.fc1.forward_nobias(x.reshape(-1, self.dim))
        a = self._children[1][1].forward_bias(z, self.fc1.P["bias"] if self.fc1.bias else None)
        return self.fc2.forward(a, training).reshape(*x.shape[:-1], self.dim)

    def backward(self, dy):
        act = self._children[1][1]
        if act._cache is None or act._cache[0] != "rows":
            return self._back(dy)
        da = self.fc2.backward(dy.reshape(-1, self.dim))
        dz, db = act.backward_bias(da, bias_grad=self.fc1.bias)
        return self.fc1.backward_with_bias_grad(dz, db).reshape(self._shape)

    def macs(self, in_shape):
        rows = math.prod(in_shape[:-1]) if len(in_shape) > 1 else 1
        return rows * (self.fc1.macs(()) + self.fc2.macs(()))

    def __repr__(self):
        return f"MLP({self.dim}, {self.hidden})"


class SwiGLU(Layer):
    """LLaMA feed-forward ``w2(silu(w1 x) ⊙ w3 x)``, no biases (Shazeer 2020).

    Children ``w1``, ``w3`` (``dim -> hidden``) and ``w2`` (``hidden -> dim``).  With
    ``a = w1 x``, ``b = w3 x``, ``σ = sigmoid(a)``: ``silu(a) = a σ``,
    ``silu'(a) = σ (1 + a (1 - σ))``.
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.dim, self.hidden = int(dim), int(hidden)
        self.w1 = self.add_child("w1", Linear(dim, hidden, bias=False))
        self.w3 = self.add_child("w3", Linear(dim, hidden, bias=False))
        self.w2 = self.add_child("w2", Linear(hidden, dim, bias=False))
        for lin in (self.w1, self.w3, self.w2):
            lin.init_std = {"weight": GPT2_INIT_STD}
        self.w2.residual_out = True

    def forward(self, x, training: bool = True):
        xp = array_module(x)
        shape = x.shape
        x2 = x.reshape(-1, self.dim)
        a, b = self.w1.forward(x2, training), self.w3.forward(x2, training)
        sig = 1.0 / (1.0 + xp.exp(-a))
        silu = a * sig
        self._cache = (shape, a, b, sig, silu)
        return self.w2.forward(silu * b, training).reshape(shape)

    def backward(self, dy):
        shape, a, b, sig, silu = self._cache
        self._cache = None
        dh = self.w2.backward(dy.reshape(-1, self.dim))
        dx = self.w3.backward(dh * silu)
        dx += self.w1.backward(dh * b * sig * (1.0 + a * (1.0 - sig)))
        return dx.reshape(shape)

    def macs(self, in_shape):
        rows = math.prod(in_shape[:-1]) if len(in_shape) > 1 else 1
        return rows * 3 * self.dim * self.hidden

    def __repr__(self):
        return f"SwiGLU({self.dim}, {self.hidden})"


class TransformerBlock(Layer):
    """One transformer block: attention and feed-forward sublayers with residual connections.

    Parameters
    ----------
    dim, heads : int
    hidden : int, optional
        Feed-forward width (default ``4 dim``).
    causal : bool
        Causal (decoder) or bidirectional (encoder) attention.
    norm_first : bool, default True
        Pre-norm ``h = x + Attn(N1 x); y = h + FF(N2 h)`` (GPT-2, ViT, LLaMA) or post-norm
        ``h = N1(x + Attn x); y = N2(h + FF h)`` (BERT, the original Transformer).
    norm : {"layer", "rms"}
    ffn : {"gelu", "swiglu"}
    bias : bool
        Biases in the attention and GELU-MLP linear maps.

    Children are registered in forward order (pre-norm: ``ln1, attn, ln2, mlp``; post-norm:
    ``attn, ln1, mlp, ln2``), so parameter gradients become ready in the layout's order.
    """

    def __init__(self, dim: int, heads: int, hidden: int | None = None, *, causal: bool = False,
                 norm_first: bool = True, norm: str = "layer", ffn: str = "gelu",
                 bias: bool = True, eps: float = 1e-5):
        super().__init__()
        if norm not in ("layer", "rms") or ffn not in ("gelu", "swiglu"):
            raise ValueError(f"norm must be 'layer' or 'rms' and ffn 'gelu' or 'swiglu', got "
                             f"{norm!r}, {ffn!r}")
        hidden = 4 * int(dim) if hidden is None else int(hidden)
        self.dim, self.heads, self.hidden = int(dim), int(heads), hidden
        self.norm_first = bool(norm_first)
        self.causal, self.norm, self.ffn = bool(causal), norm, ffn

        def make_norm():
            return LayerNorm(dim, eps) if norm == "layer" else RMSNorm(dim, eps)

        ln1, ln2 = make_norm(), make_norm()
        attn = MultiHeadSelfAttention(dim, heads, causal=causal, bias=bias)
        mlp = MLP(dim, hidden, bias=bias) if ffn == "gelu" else SwiGLU(dim, hidden)
        order = ([("ln1", ln1), ("attn", attn), ("ln2", ln2), ("mlp", mlp)] if norm_first else
                 [("attn", attn), ("ln1", ln1), ("mlp", mlp), ("ln2", ln2)])
        for name, layer in order:
            self.add_child(name, layer)
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp

    def forward(self, x, training: bool = True):
        if self.norm_first and self.norm == "layer" and self.attn.proj.bias:
            # the residual sum h = x + (attention + its projection bias) formed in ln2's pass
            r = self.attn.forward_residual(self.ln1.forward(x, training), training,
                                           proj_bias=False)
            h, a = self.ln2.forward_residual(x, r, self.attn.proj.P["bias"])
            self._fused = True
            return h + self.mlp.forward(a, training)
        self._fused = False
        if self.norm_first:
            h = x + self.attn.forward(self.ln1.forward(x, training), training)
            return h + self.mlp.forward(self.ln2.forward(h, training), training)
        h = self.ln1.forward(x + self.attn.forward(x, training), training)
        return self.ln2.forward(h + self.mlp.forward(h, training), training)

    def backward(self, dy):
        if self._fused:
            # dh = dy + ln2'(...) and its row sum (the projection's bias gradient) in one pass
            dh, db = self.ln2.backward_residual(self.mlp.backward(dy), dy, colsum=True)
            da = self.attn.backward_residual(dh, proj_bias_grad=db)
            return self.ln1.backward_residual(da, dh)[0]
        if self.norm_first:
            dh = dy + self.ln2.backward(self.mlp.backward(dy))
            return dh + self.ln1.backward(self.attn.backward(dh))
        du = self.ln2.backward(dy)
        dh = du + self.mlp.backward(du)
        dv = self.ln1.backward(dh)
        return dv + self.attn.backward(dv)

    def output_shape(self, in_shape):
        return tuple(in_shape)

    def macs(self, in_shape):
        return self.attn.macs(in_shape) + self.mlp.macs(in_shape)

    def __repr__(self):
        return (f"TransformerBlock({self.dim}, heads={self.heads}, hidden={self.hidden}, "
                f"causal={self.causal}, norm_first={self.norm_first}, norm={self.norm!r}, "
                f"ffn={self.ffn!r})")


class TokenPool(Layer):
    """``(N, T, d) -> (N, d)``: the class token (``"cls"``, position 0), the mean over tokens
    (``"mean"``) or the last position (``"last"``)."""

    def __init__(self, mode: str = "cls"):
        super().__init__()
        if mode not in ("cls", "mean", "last"):
            raise ValueError(f"TokenPool mode must be 'cls', 'mean' or 'last', got {mode!r}")
        self.mode = mode

    def forward(self, x, training: bool = True):
        self._shape = x.shape
        if self.mode == "mean":
            return x.mean(axis=1)
        return x[:, 0] if self.mode == "cls" else x[:, -1]

    def backward(self, dy):
        xp = array_module(dy)
        N, T, d = self._shape
        if self.mode == "mean":
            return xp.broadcast_to((dy / T)[:, None, :], (N, T, d)).copy()
        dx = xp.zeros((N, T, d), dtype=dy.dtype)
        dx[:, 0 if self.mode == "cls" else -1] = dy
        return dx

    def output_shape(self, in_shape):
        return (in_shape[-1],)

    def __repr__(self):
        return f"TokenPool({self.mode!r})"


class LMHead(Layer):
    """Per-position vocabulary logits ``(N, T, d) -> (N, T, V)``, ``y = x E^T`` (no bias).

    Untied: own parameter ``weight`` ``(V, d)`` (kind ``"fc"``).  Tied to an :class:`Embedding`
    (GPT-2, Radford et al. 2019): uses the embedding's table and hands its weight gradient to the
    embedding, whose backward adds it (the table's gradient is written once, in place).
    """

    def __init__(self, dim: int, vocab: int, tie: Embedding | None = None):
        super().__init__()
        self.dim, self.vocab, self.tie = int(dim), int(vocab), tie
        if tie is not None:
            if (tie.num_embeddings, tie.dim) != (vocab, dim):
                raise ValueError(f"tied LMHead ({vocab}, {dim}) does not match the embedding "
                                 f"({tie.num_embeddings}, {tie.dim})")
        else:
            self.declare_param("weight", "fc", (vocab, dim), "he")
            self.init_std = {"weight": GPT2_INIT_STD}

    def _weight(self):
        return self.tie.P["weight"] if self.tie is not None else self.P["weight"]

    def forward(self, x, training: bool = True):
        self._x = x
        return _matmul(x, self._weight().T)

    def backward(self, dy):
        x, self._x = self._x, None
        d = x.shape[-1]
        dy2, x2 = dy.reshape(-1, self.vocab), x.reshape(-1, d)
        if self.tie is not None:
            self.tie._tied_grad = _matmul(dy2.T, x2)
        else:
            _matmul(dy2.T, x2, out=self.G["weight"])
            self._emit_ready()
        return _matmul(dy, self._weight())

    def output_shape(self, in_shape):
        return (*in_shape[:-1], self.vocab)

    def macs(self, in_shape):
        return math.prod(in_shape[:-1]) * self.dim * self.vocab

    def __repr__(self):
        return f"LMHead({self.dim}, {self.vocab}, tied={self.tie is not None})"


# ---------------------------------------------------------------------------------------------
# layer trees
# ---------------------------------------------------------------------------------------------
def _blocks(depth: int, dim: int, heads: int, hidden: int | None, **kw) -> Sequential:
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    return Sequential([(str(i), TransformerBlock(dim, heads, hidden, **kw)) for i in range(depth)])


def vit_layers(input_shape, num_classes: int, *, patch: int = 2, dim: int = 64, depth: int = 4,
               heads: int = 4, mlp_ratio: float = 2.0, pool: str = "cls",
               eps: float = 1e-5) -> Sequential:
    """Vision Transformer (Dosovitskiy et al. 2021): patch embedding, ``[class]`` token (when
    ``pool="cls"``), learned positions, ``depth`` pre-norm encoder blocks, final LayerNorm, pooled
    token, linear head.  ViT-L/16: ``patch=16, dim=1024, depth=24, heads=16, mlp_ratio=4``."""
    C, H, W = (int(s) for s in input_shape)
    hidden = int(round(dim * mlp_ratio))
    patches = PatchEmbedding((C, H, W), patch, dim)
    tokens = patches.grid[0] * patches.grid[1] + (pool == "cls")
    layers: list = [("patch_embed", patches)]
    if pool == "cls":
        layers.append(("cls_token", ClassToken(dim)))
    layers += [("pos_embed", PositionEmbedding(tokens, dim)),
               ("blocks", _blocks(depth, dim, heads, hidden, causal=False, eps=eps)),
               ("norm", LayerNorm(dim, eps)), ("pool", TokenPool(pool)),
               ("head", Linear(dim, int(num_classes)))]
    layers[-1][1].init_std = {"weight": GPT2_INIT_STD}
    return Sequential(layers)


def gpt_layers(context: int, vocab: int = 256, *, dim: int = 64, depth: int = 2, heads: int = 4,
               mlp_ratio: float = 4.0, tie: bool = False, eps: float = 1e-5) -> Sequential:
    """GPT-2-style decoder (Radford et al. 2019): token + position embeddings, ``depth`` causal
    pre-norm blocks, final LayerNorm, per-position vocabulary logits (``tie``: head shares the
    token table, as GPT-2 does).  GPT2-large: ``context=1024, vocab=50257, dim=1280, depth=36,
    heads=20, tie=True``."""
    wte = Embedding(vocab, dim)
    return Sequential([
        ("wte", wte), ("wpe", PositionEmbedding(context, dim)),
        ("blocks", _blocks(depth, dim, heads, int(round(dim * mlp_ratio)), causal=True, eps=eps)),
        ("ln_f", LayerNorm(dim, eps)), ("head", LMHead(dim, vocab, tie=wte if tie else None)),
    ])


def bert_layers(context: int = 512, vocab: int = 30522, *, dim: int = 768, depth: int = 12,
                heads: int = 12, hidden: int | None = None, type_vocab: int = 2,
                eps: float = 1e-12) -> Sequential:
    """BERT encoder (Devlin et al. 2019) as HuggingFace's ``BertModel``: word + position +
    token-type embeddings, LayerNorm, ``depth`` bidirectional post-norm blocks, pooler
    (``tanh(W h_[CLS] + b)``).  Output: the pooled ``(dim,)`` vector."""
    return Sequential([
        ("word_embeddings", Embedding(vocab, dim)),
        ("position_embeddings", PositionEmbedding(context, dim)),
        ("token_type_embeddings", SegmentEmbedding(type_vocab, dim)),
        ("emb_norm", LayerNorm(dim, eps)),
        ("blocks", _blocks(depth, dim, heads, hidden, causal=False, norm_first=False, eps=eps)),
        ("cls", TokenPool("cls")), ("pooler", Linear(dim, dim)), ("pooler_act", Tanh()),
    ])


def llama_layers(context: int, vocab: int = 32000, *, dim: int = 768, depth: int = 12,
                 heads: int = 12, hidden: int = 2048, eps: float = 1e-6) -> Sequential:
    """LLaMA-style decoder (Touvron et al. 2023): token embedding, ``depth`` causal pre-norm
    blocks with RMSNorm, bias-free attention and SwiGLU, final RMSNorm, untied head.

    Rotary position embeddings have no parameters and are **not applied** here (the layer tree
    serves shape specs and small tests; positions enter only through causality)."""
    return Sequential([
        ("tok_embeddings", Embedding(vocab, dim)),
        ("layers", _blocks(depth, dim, heads, hidden, causal=True, norm="rms", ffn="swiglu",
                           bias=False, eps=eps)),
        ("norm", RMSNorm(dim, eps)), ("output", LMHead(dim, vocab)),
    ])


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
class TransformerModel(Model):
    """A :class:`Model` with GPT-2 initialization, integer-token input and the causal-LM loss.

    Parameters
    ----------
    root, input_shape, num_classes, xp, dtype, seed, name : as :class:`Model`
    lm : bool
        Language model: ``root`` maps ``(N, T)`` tokens to ``(N, T, V)`` logits, ``num_classes``
        is ``V``; :meth:`forward` returns the last position's logits and :meth:`loss_and_grad`
        averages the next-token cross-entropy over all ``N T`` positions.

    init : {"gpt2", "he"}
        ``"gpt2"`` (default): after :class:`Model`'s initialization, every tensor whose layer
        lists it in ``init_std`` is drawn from ``N(0, std^2)``; the output projections of
        residual branches (``attn.proj``, ``mlp.fc2``, ``SwiGLU.w2``) use
        ``std / sqrt(2 depth)`` (GPT-2); LayerNorm is ``(1, 0)`` and biases are 0.  The stream
        is ``default_rng([seed, 18])``: identical on every rank.  ``"he"``: keep
        :class:`Model`'s He-normal weights (``N(0, 2 / fan_in)``), which plain SGD trains
        without warm-up (the small-std GPT-2 start is meant for Adam-type optimizers).
    """

    def __init__(self, root, input_shape, num_classes, *, lm: bool = False, xp=np,
                 dtype=np.float32, seed: int = 0, name: str = "transformer",
                 init: str = "gpt2"):
        if init not in ("gpt2", "he"):
            raise ValueError(f"init must be 'gpt2' or 'he', got {init!r}")
        self.lm, self.init = bool(lm), init
        super().__init__(root, input_shape, None if lm else num_classes, xp=xp, dtype=dtype,
                         seed=seed, name=name)
        if lm:
            out = root.output_shape(self.input_shape)
            if out != (self.input_shape[0], int(num_classes)):
                raise ValueError(f"language model output {out} does not match (T, vocab) = "
                                 f"({self.input_shape[0]}, {num_classes})")
            self.num_classes = int(num_classes)
        if init == "he":
            return
        depth = sum(isinstance(layer, TransformerBlock) for _, layer in root.walk())
        rng = np.random.default_rng([self.seed, 18])
        for prefix, layer in root.walk():
            stds = getattr(layer, "init_std", None)
            if not stds:
                continue
            for local, std in stds.items():
                if getattr(layer, "residual_out", False) and depth:
                    std = std / math.sqrt(2 * depth)
                view = self.params[prefix + local]
                view[...] = xp.asarray(rng.standard_normal(view.shape) * std, dtype=self.dtype)

    def spec(self):
        """Shape-only :class:`~models.specs.ModelSpec`; a language model's ``num_classes`` is
        its vocabulary and a sample is one window of ``T`` tokens."""
        if not self.lm:
            return super().spec()
        return ModelSpec(self.name, self.input_shape, self.num_classes,
                         tuple(layer_tree_specs(self.root)), int(self.root.macs(self.input_shape)))

    def _check_input(self, x):
        if tuple(x.shape[1:]) != self.input_shape:
            dims = ", ".join(map(str, self.input_shape))
            raise ValueError(f"{self.name} expects inputs (N, {dims}), got {tuple(x.shape)}")
        if x.dtype.kind == "f" and x.dtype != self.dtype:
            x = x.astype(self.dtype)
        return x

    def sequence_logits(self, x, training: bool = True):
        """``(N, T, V)`` logits of every position (language models)."""
        return self.root.forward(self._check_input(x), training)

    def forward(self, x, training: bool = True):
        """Logits ``(N, num_classes)``; for a language model those of the last position."""
        out = self.root.forward(self._check_input(x), training)
        if self.lm:
            self._seq_shape = out.shape
            return out[:, -1]
        return out

    def backward(self, dlogits, ready=None, input_grad: bool = True):
        """Back-propagate; for a language model ``dlogits`` is ``(N, V)`` (last position, as
        :meth:`forward` returned) or ``(N, T, V)`` (every position)."""
        if self.lm and dlogits.ndim == 2:
            full = self.xp.zeros(self._seq_shape, dtype=dlogits.dtype)
            full[:, -1] = dlogits
            dlogits = full
        return super().backward(dlogits, ready=ready, input_grad=input_grad)

    @staticmethod
    def shifted_targets(x, y):
        """Next-token targets ``(N, T)``: the window shifted by one, completed by the label."""
        xp = array_module(x)
        return xp.concatenate([x[:, 1:], y[:, None].astype(x.dtype)], axis=1)

    def lm_loss(self, x, y, training: bool = False):
        """Mean next-token cross-entropy (nats) over all positions, and the ``(N, T, V)``
        logits gradient."""
        logits = self.sequence_logits(x, training)
        N, T, V = logits.shape
        targets = self.shifted_targets(x, y)
        loss, dl = softmax_cross_entropy(logits.reshape(N * T, V), targets.reshape(N * T))
        return loss, dl.reshape(N, T, V), logits

    def loss_and_grad(self, x, y, ready=None):
        """Classifier: as :class:`Model`.  Language model: the causal-LM loss over every position
        (a float), and the last position's logits (so accuracy code reads next-byte accuracy)."""
        if not self.lm:
            return super().loss_and_grad(x, y, ready=ready)
        loss, dl, logits = self.lm_loss(x, y, training=True)
        super().backward(dl, ready=ready, input_grad=False)
        return loss, logits[:, -1]

    def evaluate_lm(self, data, batch_size: int = 256) -> dict:
        """Held-out next-token loss over every position, perplexity ``exp(loss)`` and bits per
        byte ``loss / ln 2`` (evaluation mode)."""
        if not self.lm:
            raise ValueError(f"{self.name} is not a language model")
        total, count = 0.0, 0
        for x, y in iterate_batches(data, batch_size, shuffle=False):
            loss, _, _ = self.lm_loss(x, y, training=False)
            total += loss * x.shape[0] * x.shape[1]
            count += x.shape[0] * x.shape[1]
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": loss / math.log(2)}


def vit(input_shape, num_classes: int, *, xp=np, dtype=np.float32, seed: int = 0,
        patch: int = 2, dim: int = 64, depth: int = 4, heads: int = 4, mlp_ratio: float = 2.0,
        pool: str = "cls", init: str = "gpt2") -> TransformerModel:
    """Small ViT for the 8x8 digits (see :func:`vit_layers`): 16 patches of 2x2 pixels."""
    root = vit_layers(input_shape, num_classes, patch=patch, dim=dim, depth=depth, heads=heads,
                      mlp_ratio=mlp_ratio, pool=pool)
    return TransformerModel(root, input_shape, num_classes, xp=xp, dtype=dtype, seed=seed,
                            name="vit", init=init)


def gpt(input_shape, num_classes: int = 256, *, xp=np, dtype=np.float32, seed: int = 0,
        dim: int = 64, depth: int = 2, heads: int = 4, mlp_ratio: float = 4.0,
        tie: bool = False, init: str = "gpt2") -> TransformerModel:
    """Small GPT-2-style byte-level language model (see :func:`gpt_layers`).

    ``input_shape`` is ``(T,)`` (the context window) and ``num_classes`` the vocabulary (256
    bytes)."""
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 1:
        raise ValueError(f"gpt takes token windows, input_shape (T,), got {shape}; use the "
                         "'text' dataset")
    root = gpt_layers(shape[0], int(num_classes), dim=dim, depth=depth, heads=heads,
                      mlp_ratio=mlp_ratio, tie=bool(tie))
    return TransformerModel(root, shape, num_classes, lm=True, xp=xp, dtype=dtype, seed=seed,
                            name="gpt", init=init)
