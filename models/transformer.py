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

Rooms: :mod:`models.embeddings`, :mod:`models.normalization` (LayerNorm, RMSNorm),
:mod:`models.activations` (GELU, Tanh), :mod:`models.attention` (multi-head self-attention),
:mod:`models.transformer_base` (what they share); this module holds the MLPs, the block, the
heads, the layer trees and the models, and re-exports the layers.
"""

from __future__ import annotations

import math

import numpy as np

from substrate.backend import array_module

from .activations import GELU, Tanh
from .attention import ATTN_CHUNK_BYTES, ATTN_QUERY_BLOCK, MultiHeadSelfAttention
from .data import iterate_batches
from .embeddings import ClassToken, Embedding, PatchEmbedding, PositionEmbedding, SegmentEmbedding
from .layer_base import Layer, _matmul
from .layers import Linear, Sequential, softmax_cross_entropy
from .modelspec import ModelSpec, layer_tree_specs
from .network import Model
from .normalization import LayerNorm, RMSNorm
from .transformer_base import GPT2_INIT_STD, _kernels_for

__all__ = [
    "ATTN_CHUNK_BYTES",
    "ATTN_QUERY_BLOCK",
    "GELU",
    "GPT2_INIT_STD",
    "MLP",
    "ClassToken",
    "Embedding",
    "LMHead",
    "LayerNorm",
    "MultiHeadSelfAttention",
    "PatchEmbedding",
    "PositionEmbedding",
    "RMSNorm",
    "SegmentEmbedding",
    "SwiGLU",
    "Tanh",
    "TokenPool",
    "TransformerBlock",
    "TransformerModel",
    "bert_layers",
    "gpt",
    "gpt_layers",
    "llama_layers",
    "vit",
    "vit_layers",
]


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
        ("blocks", _blocks(depth, dim, heads, int(round(dim * mlp_ratio)),
                           causal=True, eps=eps)),
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
