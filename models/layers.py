"""Layers with explicit forward/backward on NumPy or CuPy arrays.

Conventions
-----------
* Activations are ``NCHW`` (images) or ``(N, features)``; conv weights ``[C_out, C_in, kH, kW]``,
  fc weights ``[d_out, d_in]`` (``y = x W^T + b``).  Shapes are always ``NCHW``; the memory
  behind them may be channels-last (conv and BatchNorm return ``NCHW`` views of ``NHWC``
  buffers, so consecutive convs need no transposes).  Every layer accepts either layout and
  gives identical values.
* A layer *declares* its parameters (name, kind, shape, initializer); :class:`models.network.Model`
  allocates one flat parameter vector and one flat gradient vector for the whole model and binds
  views into them (``layer.P[local_name]``, ``layer.G[local_name]``).  ``backward`` **writes**
  (does not accumulate) the parameter gradients and returns the input gradient.
* The array module ``xp`` is taken from the input array (:func:`substrate.backend.array_module`),
  so the same code runs on NumPy and CuPy.  The dtype follows the parameters (float32 by default,
  float64 for gradient checks).
* ``output_shape(in_shape)`` and ``macs(in_shape)`` work on per-sample shapes without arrays, so a
  layer tree doubles as a shape-only model specification (:mod:`models.specs`).
"""

from __future__ import annotations

from math import prod
from typing import Callable, Iterator, Sequence

import numpy as np

from substrate.backend import array_module

from .im2col import (Workspace, col2im, col2im_nhwc, col2im_rows, conv_output_size, im2col,
                     im2col_nhwc, im2col_rows)
from .im2col import transient as _transient
from .kernel_loader import kernels as _kernels
from .kernel_loader import numba_kernels as _numba_kernels

__all__ = [
    "Layer", "Linear", "Conv2d", "ReLU", "MaxPool2d", "GlobalAvgPool2d", "BatchNorm2d", "Flatten",
    "Sequential", "BasicBlock", "Bottleneck", "softmax_cross_entropy", "SoftmaxCrossEntropy",
    "im2col", "col2im", "im2col_rows", "col2im_rows", "im2col_nhwc", "col2im_nhwc",
    "conv_output_size", "Workspace",
]


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{what} must be an int or a pair of ints, got {v!r}")
        a, b = int(v[0]), int(v[1])
    else:
        a = b = int(v)
    return a, b


def _rows(x):
    """``(N, C, H, W)`` → its channels-last ``(N*H*W, C)`` matrix (a view when ``x`` is
    channels-last, else a copy)."""
    xp = array_module(x)
    return xp.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(-1, x.shape[1])


def _matmul(a, b, out=None):
    """``a @ b`` (into ``out``): on the Numba kernels' threads with single-threaded BLAS calls
    (:func:`models.kernels.matmul`) once they are loaded, else the array module's matmul."""
    xp = array_module(a)
    k = _numba_kernels(xp)
    if k is not None:
        return k.matmul(a, b, out)
    return xp.matmul(a, b) if out is None else xp.matmul(a, b, out=out)


def _copy_slab(dst, src, lo, hi):
    dst[lo:hi] = src[lo:hi]


def _copy(dst, src) -> None:
    """``dst[...] = src`` (same shape, any strides): the weight-layout copies of the
    convolutions, in slabs of the first axis shared over the process's threads once the Numba
    kernels are loaded (a copy: the same bits however it is cut)."""
    k = _numba_kernels(array_module(dst))
    if k is None:
        dst[...] = src
    else:
        k.parallel_for(_copy_slab, dst.shape[0], dst.size, dst, src)


def _flat_layout(*arrays):
    """1-D views of ``arrays`` in one shared memory order (row-major, or channels-last for
    4-D ``NCHW``-shaped views of ``NHWC`` memory), so element ``i`` of each view is the same
    tensor element; ``None`` when the arrays do not share such a layout."""
    if all(a.flags.c_contiguous for a in arrays):
        return [a.reshape(-1) for a in arrays]
    if all(a.ndim == 4 and a.transpose(0, 2, 3, 1).flags.c_contiguous for a in arrays):
        return [a.transpose(0, 2, 3, 1).reshape(-1) for a in arrays]
    return None


def _empty_like_layout(x, dtype=None):
    """An empty array shaped like ``x`` with the same memory order (row-major or
    channels-last), so :func:`_flat_layout` pairs them."""
    dtype = x.dtype if dtype is None else dtype
    if not x.flags.c_contiguous and x.ndim == 4:
        N, C, H, W = x.shape
        return np.empty((N, H, W, C), dtype=dtype).transpose(0, 3, 1, 2)
    return np.empty(x.shape, dtype=dtype)


def _channel_sum(m):
    """Column sums of the ``(M, C)`` matrix ``m`` with float64 accumulation, in ``m.dtype``."""
    xp = array_module(m)
    return m.sum(axis=0, dtype=xp.float64).astype(m.dtype)


# ---------------------------------------------------------------------------------------------
# base class
# ---------------------------------------------------------------------------------------------
class Layer:
    """Base class: parameter declarations, children, views bound by the model.

    Subclasses call :meth:`declare_param` / :meth:`declare_buffer` / :meth:`add_child` in their
    constructor, in **forward execution order**, and implement ``forward``, ``backward``,
    ``output_shape`` and ``macs``.
    """

    def __init__(self) -> None:
        self._param_decls: list[tuple[str, str, tuple[int, ...], str]] = []
        self._buffer_decls: list[tuple[str, tuple[int, ...], float]] = []
        self._children: list[tuple[str, Layer]] = []
        #: parameter views (local name -> array), bound by the model
        self.P: dict = {}
        #: gradient views (local name -> array), bound by the model
        self.G: dict = {}
        #: buffers (local name -> array), bound by the model
        self.B: dict = {}
        self._ready: Callable[[str], None] | None = None
        self._ready_names: tuple[str, ...] = ()

    # -- declarations ---------------------------------------------------------------------------
    def declare_param(self, local: str, kind: str, shape: Sequence[int], init: str) -> None:
        """Declare a trainable tensor (``init`` in ``{"he", "zeros", "ones"}``)."""
        if init not in ("he", "zeros", "ones"):
            raise ValueError(f"unknown initializer {init!r}; use 'he', 'zeros' or 'ones'")
        self._param_decls.append((local, kind, tuple(int(s) for s in shape), init))

    def declare_buffer(self, local: str, shape: Sequence[int], fill: float) -> None:
        """Declare a non-trainable state tensor (e.g. BatchNorm running statistics)."""
        self._buffer_decls.append((local, tuple(int(s) for s in shape), float(fill)))

    def add_child(self, local: str, layer: "Layer") -> "Layer":
        """Register ``layer`` as a child named ``local`` (forward execution order)."""
        if not isinstance(layer, Layer):
            raise ValueError(f"child {local!r} must be a Layer, got {type(layer).__name__}")
        if any(n == local for n, _ in self._children):
            raise ValueError(f"duplicate child name {local!r}")
        self._children.append((local, layer))
        return layer

    def children(self) -> list[tuple[str, "Layer"]]:
        return list(self._children)

    def walk(self, prefix: str = "") -> Iterator[tuple[str, "Layer"]]:
        """Pre-order traversal yielding ``(dotted_prefix, layer)``; own params before children."""
        yield prefix, self
        for local, child in self._children:
            yield from child.walk(f"{prefix}{local}.")

    # -- gradient-ready notification ------------------------------------------------------------
    def _emit_ready(self) -> None:
        """Tell the model this layer's gradients are written (backward order within the layer)."""
        if self._ready is not None:
            for name in self._ready_names:
                self._ready(name)

    # -- interface ------------------------------------------------------------------------------
    def forward(self, x, training: bool = True):  # pragma: no cover - abstract
        """Compute the output for a batch ``x`` and cache what backward needs.

        Parameters
        ----------
        x : array (N, ...)
            NumPy or CuPy; the layer computes with the same module.
        training : bool
            Training mode (BatchNorm uses and updates batch statistics).
        """
        raise NotImplementedError

    def backward(self, dy):  # pragma: no cover - abstract
        """Given ``dL/dy`` of the last forward, write parameter gradients into ``G``
        (overwrite, not accumulate) and return ``dL/dx``."""
        raise NotImplementedError

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-sample output shape (batch dimension excluded)."""
        return tuple(in_shape)

    def macs(self, in_shape: tuple[int, ...]) -> int:
        """Multiply-accumulates of the forward pass per sample (conv and fc only)."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# ---------------------------------------------------------------------------------------------
# parametric layers
# ---------------------------------------------------------------------------------------------
class Linear(Layer):
    """Fully connected layer ``y = x W^T + b`` with ``W`` of shape ``(out_features, in_features)``.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool, default True
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"Linear needs positive sizes, got in={in_features}, out={out_features}")
        self.in_features, self.out_features, self.bias = int(in_features), int(out_features), bias
        self.declare_param("weight", "fc", (out_features, in_features), "he")
        if bias:
            self.declare_param("bias", "bias", (out_features,), "zeros")

    def forward(self, x, training: bool = True):
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"Linear expects input (N, {self.in_features}), got {tuple(x.shape)}")
        self._x = x
        y = _matmul(x, self.P["weight"].T)
        if self.bias:
            y += self.P["bias"]
        return y

    def backward(self, dy):
        return self.backward_with_bias_grad(dy, dy.sum(axis=0) if self.bias else None)

    def forward_nobias(self, x):
        """``x W^T`` without the bias, for a caller that adds it in a pass of its own (the
        transformer's fused residual, LayerNorm and GELU passes); caches ``x`` as
        :meth:`forward`."""
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"Linear expects input (N, {self.in_features}), got {tuple(x.shape)}")
        self._x = x
        return _matmul(x, self.P["weight"].T)

    def backward_with_bias_grad(self, dy, dbias):
        """:meth:`backward` with the bias gradient ``dbias`` (``Σ_rows dy``) supplied by the
        caller (summed in a fused pass; ignored without a bias): writes ``dW = dy^T x`` and the
        bias gradient, announces them, returns ``dy W``."""
        x = self._x
        _matmul(dy.T, x, out=self.G["weight"])
        if self.bias:
            self.G["bias"][...] = dbias
        self._emit_ready()
        return _matmul(dy, self.P["weight"])

    def output_shape(self, in_shape):
        if prod(in_shape) != self.in_features:
            raise ValueError(f"Linear expects {self.in_features} features, got shape {in_shape}")
        return (self.out_features,)

    def macs(self, in_shape):
        return self.in_features * self.out_features

    def __repr__(self):
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias})"


#: Winograd convs (:meth:`Conv2d._winograd`): at least this many input and output channels
#: (fewer: the transforms cost more than the multiplications they save)
WINOGRAD_MIN_CHANNELS = 16
#: ... and at least this many pixels per image (ResNet-18's 4x4 stage gains too: 2.4 % of the
#: step at batch 32, 12 % at 128; below 4x4 a 2x2 tile grid is mostly border)
WINOGRAD_MIN_HW = 16
#: ... tiles per block (one block's transformed input and products stay in the larger caches)
WINOGRAD_TILES = 1024

#: blocked convs (:meth:`Conv2d._block_images`): im2col rows per block (a few MiB: cache-resident)
BLOCK_ROWS = 2048
#: ... only for GEMMs this thin (output channels), whose cost is packing ``cols`` from memory
BLOCK_MAX_COUT = 64
#: ... and only when the batch makes at least this many blocks
BLOCK_MIN_BLOCKS = 4


class Conv2d(Layer):
    """2-D cross-correlation (PyTorch ``Conv2d`` semantics) via channels-last im2col + one GEMM.

    The interface is ``NCHW``; internally the layer works *channels-last*: the output is an
    ``(N, C_out, Ho, Wo)`` view of an ``(N, Ho, Wo, C_out)`` buffer (PyTorch's ``channels_last``
    memory format; same shape and values, other strides), so the GEMM writes it directly with no
    transpose, and a following conv reads it with no copy.

    Forward: ``Y = cols @ W_mat^T`` with ``cols`` ``(N*Ho*Wo, kH*kW*C_in)`` from
    :func:`im2col_nhwc` and ``W_mat`` ``(C_out, kH*kW*C_in)`` (the weight with its input channel
    innermost).  Backward: ``dW = dY^T @ cols``; ``dX`` either as the *full* cross-correlation of
    ``dY`` with the flipped, transposed kernel (stride 1: one more im2col + GEMM, the adjoint of
    a stride-1 conv is a stride-1 conv) or as ``col2im(dY @ W_mat)`` (strided convs).  1x1
    stride-1 convs need no im2col at all.

    *Blocked* convs (:meth:`_block_images`: NumPy arrays, stride 1, at most
    :data:`BLOCK_MAX_COUT` output channels, at least :data:`BLOCK_MIN_BLOCKS` blocks) run the
    same products one block of images at a time: the block's im2col rows (about
    :data:`BLOCK_ROWS`, cache-resident) go straight into their GEMM, and backward rebuilds them
    from the cached input instead of keeping the whole im2col matrix.  Their GEMMs have a thin
    output (``C_out`` columns), so OpenBLAS's packing of the tall ``cols`` operand, read from
    memory, costs as much as the arithmetic; from cache it does not (ResNet-18 at CIFAR shape,
    batch 32: the four 64-channel 3x3 convs ~15 % faster, 75 MiB less memory each).  ``dW`` is
    the sum of the blocks' ``dY_b^T cols_b`` (float32 round-off from the one-GEMM sum).

    *Winograd* convs (:meth:`_winograd`: NumPy arrays with the Numba kernels loaded, 3x3,
    stride 1, padding 1, even ``H``, ``W`` with ``H W >=`` :data:`WINOGRAD_MIN_HW`, at least
    :data:`WINOGRAD_MIN_CHANNELS` channels in and out: every 3x3 conv of a ResNet-18 but the
    stem and the strided ones) use F(2x2, 3x3) (Lavin & Gray 2016): per 2x2 output tile and
    channel pair 16 multiplications instead of 36, as 16 GEMMs ``M[e] = V[e] U[e]`` over blocks
    of :data:`WINOGRAD_TILES` tiles between the input transform ``V = B^T d B`` and the output
    transform ``A^T m A`` (:mod:`models.kernels`).  The input gradient is the same convolution
    of ``dY`` with the flipped kernel (channels swapped); the weight gradient is the adjoint,
    ``dU[e] = Σ V[e]^T dM[e]`` with ``dM = A dy A^T``, then ``dW = G^T dU G``.  Values agree
    with the loop definition to round-off (float32: about twice the im2col path's error;
    ``WINOGRAD_MIN_CHANNELS = sys.maxsize`` turns the path off).  ResNet-18 at CIFAR shape, one
    thread: step 23 % faster at batch 32, more at 128.  All GEMMs go through
    :func:`models.kernels.matmul` once the kernels are loaded (parts on the process's threads).

    With ``input_grad`` set to ``False`` (the layer that reads the data, during
    :meth:`models.network.Model.loss_and_grad`) backward stops after the weight gradient and
    returns ``None``.

    Parameters
    ----------
    in_channels, out_channels : int
    kernel_size : int or (int, int)
    stride : int or (int, int), default 1
    padding : int or (int, int), default 0
        Zero padding on each side.
    bias : bool, default True
    """

    #: :meth:`backward` returns ``None`` without computing the input gradient while
    #: ``input_grad`` is ``False`` (:meth:`models.network.Model.backward` sets it on the layer
    #: that reads the data, whose gradient training discards); only a class that sets this
    #: itself is asked (a subclass overriding ``backward`` opts in explicitly)
    skips_input_grad = True

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 bias: bool = True):
        super().__init__()
        self.input_grad = True
        if in_channels <= 0 or out_channels <= 0:
            raise ValueError(
                f"Conv2d needs positive channel counts, got {in_channels}->{out_channels}")
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.padding = _pair(padding, "padding")
        if min(self.kernel_size) < 1 or min(self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(
                f"Conv2d needs kernel_size >= 1, stride >= 1, padding >= 0; got "
                f"{self.kernel_size}, {self.stride}, {self.padding}")
        self.bias = bias
        kh, kw = self.kernel_size
        self._ws = Workspace()
        self.declare_param("weight", "conv", (out_channels, in_channels, kh, kw), "he")
        if bias:
            self.declare_param("bias", "bias", (out_channels,), "zeros")

    def _out_hw(self, H: int, W: int) -> tuple[int, int]:
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        return conv_output_size(H, kh, sh, ph), conv_output_size(W, kw, sw, pw)

    def _pointwise(self) -> bool:
        return self.kernel_size == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0)

    def _transposed_input_grad(self) -> bool:
        """Input gradient as a stride-1 full correlation (else col2im): stride 1, padding below
        the kernel size, and ``C_out <= 2 C_in`` (the im2col of ``dY`` is ``C_out/C_in`` times
        the size of the col2im of ``dX``; a 3-channel stem conv takes col2im)."""
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        return (self.stride == (1, 1) and ph <= kh - 1 and pw <= kw - 1
                and self.out_channels <= 2 * self.in_channels)

    def _winograd(self, xp, H: int, W: int) -> bool:
        """Winograd F(2x2, 3x3) path: NumPy arrays with the Numba kernels loaded, a 3x3 kernel,
        stride 1, padding 1, even ``H`` and ``W`` of at least :data:`WINOGRAD_MIN_HW`, and at
        least :data:`WINOGRAD_MIN_CHANNELS` input and output channels."""
        return (self.kernel_size == (3, 3) and self.stride == (1, 1) and self.padding == (1, 1)
                and H % 2 == 0 and W % 2 == 0 and H * W >= WINOGRAD_MIN_HW
                and min(self.in_channels, self.out_channels) >= WINOGRAD_MIN_CHANNELS
                and _numba_kernels(xp) is not None)

    def _wino_blocks(self, N: int, H: int, W: int):
        """``(n0, n1)`` image ranges of about :data:`WINOGRAD_TILES` tiles each."""
        per = max(1, WINOGRAD_TILES // ((H // 2) * (W // 2)))
        return [(n0, min(N, n0 + per)) for n0 in range(0, N, per)]

    def _wino_conv(self, k, Xp, U, bias, Y, tag: str) -> None:
        """``Y`` (N, H, W, K) = the 3x3 stride-1 padding-1 convolution of the image whose
        zero-padded copy is ``Xp`` (N, H+2, W+2, C), with the transformed kernel ``U``
        (16, C, K), block of images by block: input transform, 16 GEMMs ``M[e] = V[e] U[e]``,
        output transform (+ bias)."""
        N, H, W, C = Xp.shape[0], Xp.shape[1] - 2, Xp.shape[2] - 2, Xp.shape[3]
        P, K = (H // 2) * (W // 2), U.shape[2]
        for n0, n1 in self._wino_blocks(N, H, W):
            T = (n1 - n0) * P
            V = _transient(f"wino_v{tag}", (16, T, C), Xp.dtype, np)
            M = _transient(f"wino_m{tag}", (16, T, K), Xp.dtype, np)
            k.winograd_input(Xp, n0, n1, V)
            _matmul(V, U, out=M)
            k.winograd_output(M, n0, bias, Y)

    def _forward_winograd(self, xl):
        """Forward by Winograd F(2x2, 3x3) (Lavin & Gray 2016): 16 multiplications per 2x2
        output tile and channel pair instead of 36 (the transforms in :mod:`models.kernels`);
        caches the input."""
        k = _numba_kernels(np)
        N, H, W, C = xl.shape
        Xp = self._ws.get("wino_xpad", (N, H + 2, W + 2, C), xl.dtype, np)
        k.pad1(np.ascontiguousarray(xl), Xp)
        U = self._ws.get("wino_u", (16, C, self.out_channels), xl.dtype, np)
        k.winograd_weight(self.P["weight"], U)
        Y = np.empty((N, H, W, self.out_channels), dtype=xl.dtype)
        self._wino_conv(k, Xp, U, self.P["bias"] if self.bias else None, Y, "f")
        self._cache = (Xp, (N, H, W, C), (H, W), "winograd")
        return Y.transpose(0, 3, 1, 2)

    def _backward_winograd(self, Xp, dyl):
        """``dW`` as the adjoint of the Winograd forward (``dU[e] = Σ_blocks V[e]^T dM[e]``
        with ``dM`` the adjoint output transform of ``dY``, then ``dW = G^T dU G``), announced;
        then ``dX`` as the Winograd convolution of ``dY`` with the flipped kernel (channels
        swapped)."""
        k = _numba_kernels(np)
        N, H, W, C = Xp.shape[0], Xp.shape[1] - 2, Xp.shape[2] - 2, Xp.shape[3]
        dtype = Xp.dtype
        c_out = self.out_channels
        P = (H // 2) * (W // 2)
        dU = self._ws.get("wino_du", (16, C, c_out), dtype, np)
        part = self._ws.get("wino_du_part", (16, C, c_out), dtype, np)
        for b, (n0, n1) in enumerate(self._wino_blocks(N, H, W)):
            T = (n1 - n0) * P
            V = _transient("wino_vf", (16, T, C), dtype, np)
            dM = _transient("wino_mf", (16, T, c_out), dtype, np)
            k.winograd_input(Xp, n0, n1, V)
            k.winograd_output_adjoint(dyl, n0, dM)
            _matmul(V.transpose(0, 2, 1), dM, out=part if b else dU)
            if b:
                dU += part
        k.winograd_weight_grad(dU, self.G["weight"])
        self._weight_grad_done(None, dyl.reshape(-1, c_out))
        if not self.input_grad:
            return None
        Ut = self._ws.get("wino_ut", (16, c_out, C), dtype, np)
        k.winograd_weight(self.P["weight"], Ut, flip=True)
        dYp = _transient("wino_dypad", (N, H + 2, W + 2, c_out), dtype, np)
        k.pad1(dyl, dYp)
        dX = np.empty((N, H, W, C), dtype=dtype)
        self._wino_conv(k, dYp, Ut, None, dX, "b")
        return dX.transpose(0, 3, 1, 2)

    def _block_images(self, xp, N: int, Ho: int, Wo: int) -> int:
        """Images per block of the blocked path, or 0 to take one GEMM over the batch."""
        if (xp is not np or not self._transposed_input_grad()
                or self._pointwise() or self.out_channels > BLOCK_MAX_COUT):
            return 0
        per = max(1, BLOCK_ROWS // (Ho * Wo))
        return per if N >= BLOCK_MIN_BLOCKS * per else 0

    def forward(self, x, training: bool = True):
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"Conv2d expects input (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        xp = array_module(x)
        N, C, H, W = x.shape
        kh, kw = self.kernel_size
        Ho, Wo = self._out_hw(H, W)
        c_out, K = self.out_channels, C * kh * kw
        ws = self._ws
        xl = x.transpose(0, 2, 3, 1)                        # (N, H, W, C) view
        if self._winograd(xp, H, W):
            return self._forward_winograd(xl)
        per = self._block_images(xp, N, Ho, Wo)
        if per:
            return self._forward_blocked(xl, per)
        if training:                                        # cols kept for backward
            cols = self._cols(xl, ws.get("cols", (N * Ho * Wo, K), x.dtype, xp))
        else:                                               # freed after the call
            cols = self._cols(xl, None, Workspace())
        w_mat = self._w_mat(x.dtype, xp)                   # (C_out, kh*kw*C_in)
        y = xp.empty((N * Ho * Wo, c_out), dtype=x.dtype)
        _matmul(cols, w_mat.T, out=y)
        if self.bias:
            y += self.P["bias"]
        # evaluation keeps no im2col matrix or padded copy (rank 0's evaluation models would
        # hold one per layer and batch shape); a backward after it rebuilds them from the input
        self._cache = (cols if training else xl, (N, H, W, C), (Ho, Wo), 0)
        return y.reshape(N, Ho, Wo, c_out).transpose(0, 3, 1, 2)

    def _w_mat(self, dtype, xp):
        """The weight as ``W_mat`` ``(C_out, kh*kw*C_in)`` (input channel innermost)."""
        c_out, C = self.out_channels, self.in_channels
        kh, kw = self.kernel_size
        w_mat = self._ws.get("w_mat", (c_out, kh * kw * C), dtype, xp)
        _copy(w_mat.reshape(c_out, kh, kw, C), self.P["weight"].transpose(0, 2, 3, 1))
        return w_mat

    def _blocks(self, N: int, per: int, rows: int):
        """``(first image, last image + 1, first row, last row + 1)`` of each block."""
        for n0 in range(0, N, per):
            n1 = min(N, n0 + per)
            yield n0, n1, n0 * rows, n1 * rows

    def _forward_blocked(self, xl, per: int):
        """``Y_b = cols_b @ W_mat^T`` block by block (the class docstring); caches the input
        (training or evaluation alike: backward rebuilds the blocks either way)."""
        xp = np
        N, H, W, C = xl.shape
        kh, kw = self.kernel_size
        Ho, Wo = self._out_hw(H, W)
        c_out, K = self.out_channels, C * kh * kw
        w_mat = self._w_mat(xl.dtype, xp)
        buf = _transient("cols_block", (per * Ho * Wo, K), xl.dtype, xp)
        y = xp.empty((N * Ho * Wo, c_out), dtype=xl.dtype)
        for n0, n1, r0, r1 in self._blocks(N, per, Ho * Wo):
            cols = im2col_nhwc(xl[n0:n1], kh, kw, self.stride, self.padding,
                               out=buf[:r1 - r0])
            _matmul(cols, w_mat.T, out=y[r0:r1])
        if self.bias:
            y += self.P["bias"]
        self._cache = (xl, (N, H, W, C), (Ho, Wo), per)
        return y.reshape(N, Ho, Wo, c_out).transpose(0, 3, 1, 2)

    def _backward_blocked(self, xl, dyl, per: int):
        """``dW = sum_b dY_b^T cols_b`` (each ``cols_b`` rebuilt from the cached input), then
        ``dX_b`` as the full correlation of ``dY_b`` with the flipped kernel, block by block."""
        xp = np
        N, H, W, C = xl.shape
        kh, kw = self.kernel_size
        (ph, pw), c_out = self.padding, self.out_channels
        Ho, Wo = self._out_hw(H, W)
        K = C * kh * kw
        dym = dyl.reshape(N * Ho * Wo, c_out)
        buf = _transient("cols_block", (per * Ho * Wo, K), xl.dtype, xp)
        g_mat = self._ws.get("g_mat", (c_out, K), dyl.dtype, xp)
        part = self._ws.get("g_part", (c_out, K), dyl.dtype, xp)
        for b, (n0, n1, r0, r1) in enumerate(self._blocks(N, per, Ho * Wo)):
            cols = im2col_nhwc(xl[n0:n1], kh, kw, self.stride, self.padding,
                               out=buf[:r1 - r0])
            _matmul(dym[r0:r1].T, cols, out=part if b else g_mat)
            if b:
                g_mat += part
        self._weight_grad_done(g_mat, dym)
        if not self.input_grad:
            return None
        w_flip = self._w_flip(dyl.dtype, xp)
        dbuf = _transient("dcols_block", (per * H * W, kh * kw * c_out), dyl.dtype, xp)
        dx = xp.empty((N * H * W, C), dtype=dyl.dtype)
        for n0, n1, r0, r1 in self._blocks(N, per, H * W):
            dcols = im2col_nhwc(dyl[n0:n1], kh, kw, (1, 1), (kh - 1 - ph, kw - 1 - pw),
                                out=dbuf[:r1 - r0])
            _matmul(dcols, w_flip, out=dx[r0:r1])
        return dx.reshape(N, H, W, C).transpose(0, 3, 1, 2)

    def _weight_grad_done(self, g_mat, dym) -> None:
        """Store ``dW`` from ``g_mat`` (``W_mat`` layout; ``None``: already in place) and the
        bias gradient, announce the gradients ready, drop the forward cache."""
        if g_mat is not None:
            kh, kw = self.kernel_size
            _copy(self.G["weight"], g_mat.reshape(self.out_channels, kh, kw, self.in_channels)
                  .transpose(0, 3, 1, 2))
        if self.bias:
            self.G["bias"][...] = _channel_sum(dym)
        self._emit_ready()
        self._cache = None

    def _w_flip(self, dtype, xp):
        """The kernel flipped in space with ``C_in`` and ``C_out`` swapped, as a
        ``(kh*kw*C_out, C_in)`` matrix (the stride-1 input gradient's weight)."""
        c_out, C = self.out_channels, self.in_channels
        kh, kw = self.kernel_size
        w_flip = self._ws.get("w_flip", (kh * kw * c_out, C), dtype, xp)
        _copy(w_flip.reshape(kh, kw, c_out, C).transpose(2, 0, 1, 3),   # C_out first
              self.P["weight"][:, :, ::-1, ::-1].transpose(0, 2, 3, 1))
        return w_flip

    def _cols(self, xl, out, ws: Workspace | None = None):
        """The im2col matrix of ``xl`` (the input itself for a 1x1 stride-1 conv)."""
        N, H, W, C = xl.shape
        if self._pointwise() and xl.flags.c_contiguous:
            return xl.reshape(N * H * W, C)
        kh, kw = self.kernel_size
        return im2col_nhwc(xl, kh, kw, self.stride, self.padding, out=out, ws=ws)

    def backward(self, dy):
        xp = array_module(dy)
        cols, in_nhwc, (Ho, Wo), per = self._cache
        N, H, W, C = in_nhwc
        kh, kw = self.kernel_size
        c_out = self.out_channels
        ws = self._ws
        dyl = xp.ascontiguousarray(dy.transpose(0, 2, 3, 1))     # no copy if channels-last
        if per == "winograd":
            return self._backward_winograd(cols, dyl)
        if per:                         # blocked forward: the cache holds the input
            return self._backward_blocked(cols, dyl, per)
        if cols.ndim == 4:                                  # after an evaluation forward
            cols = self._cols(cols, ws.get("cols", (N * Ho * Wo, C * kh * kw), dy.dtype, xp))
        dym = dyl.reshape(N * Ho * Wo, c_out)
        w_mat = ws.get("w_mat", (c_out, C * kh * kw), dy.dtype, xp)
        gw = self.G["weight"]
        if kh == kw == 1:
            _matmul(dym.T, cols, out=gw.reshape(c_out, C))
            self._weight_grad_done(None, dym)
        else:
            g_mat = ws.get("g_mat", (c_out, C * kh * kw), dy.dtype, xp)
            _matmul(dym.T, cols, out=g_mat)
            self._weight_grad_done(g_mat, dym)
        if not self.input_grad:
            return None
        if self._pointwise():
            dx = _matmul(dym, w_mat)
        elif self._transposed_input_grad():
            ph, pw = self.padding
            # dX = full correlation of dY with W flipped in space, C_in and C_out swapped
            w_flip = self._w_flip(dy.dtype, xp)
            dcols = im2col_nhwc(dyl, kh, kw, (1, 1), (kh - 1 - ph, kw - 1 - pw),
                                out=_transient("dcols", (N * H * W, kh * kw * c_out),
                                               dy.dtype, xp))
            dx = _matmul(dcols, w_flip)
        else:
            dcols = _transient("dcols", (N * Ho * Wo, C * kh * kw), dy.dtype, xp)
            _matmul(dym, w_mat, out=dcols)
            dx = col2im_nhwc(dcols, in_nhwc, kh, kw, self.stride, self.padding)
        return dx.reshape(N, H, W, C).transpose(0, 3, 1, 2)

    def output_shape(self, in_shape):
        C, H, W = in_shape
        if C != self.in_channels:
            raise ValueError(f"Conv2d expects {self.in_channels} channels, got shape {in_shape}")
        return (self.out_channels, *self._out_hw(H, W))

    def macs(self, in_shape):
        _, Ho, Wo = self.output_shape(in_shape)
        kh, kw = self.kernel_size
        return Ho * Wo * self.out_channels * self.in_channels * kh * kw

    def __repr__(self):
        return (f"Conv2d({self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias})")


class BatchNorm2d(Layer):
    """Batch normalization over ``(N, H, W)`` per channel.

    Training: normalize with the batch mean and the biased batch variance, then update
    ``running = (1 - momentum) * running + momentum * batch_stat`` with the *unbiased* variance
    ``var * M / (M - 1)``, ``M = N*H*W`` (PyTorch semantics).  Evaluation: normalize with the
    running statistics.

    Parameters
    ----------
    num_features : int
    momentum : float, default 0.1
    eps : float, default 1e-5
    """

    def __init__(self, num_features: int, momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        if num_features <= 0:
            raise ValueError(f"BatchNorm2d needs num_features > 0, got {num_features}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm2d momentum must be in [0, 1], got {momentum}")
        if eps <= 0:
            raise ValueError(f"BatchNorm2d eps must be > 0, got {eps}")
        self.num_features, self.momentum, self.eps = int(num_features), float(momentum), float(eps)
        self.declare_param("weight", "bn", (num_features,), "ones")
        self.declare_param("bias", "bn", (num_features,), "zeros")
        self.declare_buffer("running_mean", (num_features,), 0.0)
        self.declare_buffer("running_var", (num_features,), 1.0)

    def forward(self, x, training: bool = True):
        if x.ndim != 4 or x.shape[1] != self.num_features:
            raise ValueError(
                f"BatchNorm2d expects (N, {self.num_features}, H, W), got {tuple(x.shape)}")
        xp = array_module(x)
        if training and x.shape[0] * x.shape[2] * x.shape[3] < 2:
            raise ValueError("BatchNorm2d in training mode needs more than one value per "
                             "channel (batch*H*W >= 2); use a larger batch or eval mode")
        k = _kernels() if xp.__name__ == "numpy" else None
        if k is None:
            return self._forward_xp(x, training)
        return self._forward_kernels(k, x, training)

    def _update_running(self, mean, var, m: int) -> None:
        """``running = (1 - momentum) running + momentum batch`` (unbiased variance)."""
        mom = self.momentum
        rm, rv = self.B["running_mean"], self.B["running_var"]
        rm *= 1.0 - mom
        rm += (mom * mean).astype(rm.dtype)
        rv *= 1.0 - mom
        rv += ((mom * m / (m - 1)) * var).astype(rv.dtype)

    def _forward_kernels(self, k, x, training: bool):
        """Channels-last Numba path: statistics in one pass (float64), output in a second."""
        N, C, H, W = x.shape
        X = _rows(x)                                       # (N*H*W, C)
        if training:
            mean, var = k.channel_stats(X)
            self._update_running(mean, var, X.shape[0])
        else:
            mean = self.B["running_mean"].astype(np.float64)
            var = self.B["running_var"].astype(np.float64)
        inv_std = 1.0 / np.sqrt(var + self.eps)
        gamma = self.P["weight"].astype(np.float64)
        Y = np.empty_like(X)
        k.bn_apply(X, mean, gamma * inv_std, self.P["bias"].astype(np.float64), Y)
        self._cache = ("rows", X, mean, inv_std, training)
        return Y.reshape(N, H, W, C).transpose(0, 3, 1, 2)

    def _forward_xp(self, x, training: bool):
        """Array-module path (CuPy, or NumPy without Numba): ``NCHW`` reductions."""
        xp = array_module(x)
        gamma, beta = self.P["weight"], self.P["bias"]
        if training:
            m = x.shape[0] * x.shape[2] * x.shape[3]
            mean = x.mean(axis=(0, 2, 3))
            xc = x - mean[:, None, None]
            var = (xc * xc).mean(axis=(0, 2, 3))
            inv_std = 1.0 / xp.sqrt(var + self.eps)
            self._update_running(mean, var, m)
        else:
            xc = x - self.B["running_mean"][:, None, None]
            inv_std = 1.0 / xp.sqrt(self.B["running_var"] + self.eps)
        x_hat = xc * inv_std[:, None, None]
        self._cache = ("xp", x_hat, inv_std, training)
        return x_hat * gamma[:, None, None] + beta[:, None, None]

    def backward(self, dy):
        if self._cache[0] == "rows":
            return self._backward_kernels(dy)
        _, x_hat, inv_std, training = self._cache
        gamma = self.P["weight"]
        d_beta = dy.sum(axis=(0, 2, 3))
        d_gamma = (dy * x_hat).sum(axis=(0, 2, 3))
        self.G["bias"][...] = d_beta
        self.G["weight"][...] = d_gamma
        self._emit_ready()
        self._cache = None
        if not training:
            return dy * (gamma * inv_std)[:, None, None]
        m = dy.shape[0] * dy.shape[2] * dy.shape[3]
        scale = (gamma * inv_std / m)[:, None, None]
        return scale * (m * dy - d_beta[:, None, None] - x_hat * d_gamma[:, None, None])

    def _backward_kernels(self, dy):
        k = _kernels()
        _, X, mean, inv_std, training = self._cache
        N, C, H, W = dy.shape
        dY = _rows(dy)
        d_beta, d_gamma = k.bn_backward_sums(dY, X, mean, inv_std)
        self.G["bias"][...] = d_beta
        self.G["weight"][...] = d_gamma
        self._emit_ready()
        self._cache = None
        gamma = self.P["weight"].astype(np.float64)
        dX = np.empty_like(dY)
        if training:
            k.bn_backward_input(dY, X, mean, inv_std, gamma, d_beta, d_gamma, dX)
        else:                                              # running statistics are constants
            k.bn_apply(dY, np.zeros_like(mean), gamma * inv_std, np.zeros_like(mean), dX)
        return dX.reshape(N, H, W, C).transpose(0, 3, 1, 2)

    def __repr__(self):
        return f"BatchNorm2d({self.num_features}, momentum={self.momentum}, eps={self.eps})"


# ---------------------------------------------------------------------------------------------
# parameter-free layers
# ---------------------------------------------------------------------------------------------
class ReLU(Layer):
    """``y = max(x, 0)`` (as ``x * (x > 0)``); the subgradient at 0 is 0.

    With the Numba kernels loaded, NumPy arrays take one parallel pass each way that keeps the
    input's memory order (channels-last stays channels-last); the values are the same.
    """

    def forward(self, x, training: bool = True):
        k = _numba_kernels(array_module(x))
        if k is not None and x.dtype.kind == "f":
            y, mask = _empty_like_layout(x), _empty_like_layout(x, np.bool_)
            flat = _flat_layout(x, y, mask)
            if flat is not None:
                k.relu_forward(*flat)
                self._mask = mask
                return y
        self._mask = x > 0
        return x * self._mask

    def forward_sum(self, a, b, training: bool = True):
        """``relu(a + b)`` (a residual block's output), fused into one pass when it can be."""
        k = _numba_kernels(array_module(a))
        if k is not None and a.dtype.kind == "f" and a.dtype == b.dtype and a.shape == b.shape:
            y, mask = _empty_like_layout(a), _empty_like_layout(a, np.bool_)
            flat = _flat_layout(a, b, y, mask)
            if flat is not None:
                k.add_relu_forward(*flat)
                self._mask = mask
                return y
        return self.forward(a + b, training)

    def backward(self, dy):
        mask, self._mask = self._mask, None
        k = _numba_kernels(array_module(dy))
        if k is not None and dy.shape == mask.shape:
            dx = _empty_like_layout(mask, dy.dtype)
            flat = _flat_layout(dy, mask, dx)
            if flat is not None:
                k.relu_backward(*flat)
                return dx
        return dy * mask


class MaxPool2d(Layer):
    """Max pooling over ``kernel_size`` windows with ``stride`` (default = kernel_size), no padding.

    Gradient goes to the first maximum of each window (ties broken by window position).
    """

    def __init__(self, kernel_size, stride=None):
        super().__init__()
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else _pair(stride, "stride")
        if min(self.kernel_size) < 1 or min(self.stride) < 1:
            raise ValueError(f"MaxPool2d needs kernel_size, stride >= 1, got "
                             f"{self.kernel_size}, {self.stride}")

    def _out_hw(self, H, W):
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        return conv_output_size(H, kh, sh, 0), conv_output_size(W, kw, sw, 0)

    def forward(self, x, training: bool = True):
        if x.ndim != 4:
            raise ValueError(f"MaxPool2d expects (N, C, H, W), got {tuple(x.shape)}")
        xp = array_module(x)
        N, C, H, W = x.shape
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        Ho, Wo = self._out_hw(H, W)
        bN, bC, bH, bW = x.strides
        win = xp.lib.stride_tricks.as_strided(
            x, shape=(N, C, Ho, Wo, kh, kw), strides=(bN, bC, bH * sh, bW * sw, bH, bW)
        ).reshape(N, C, Ho, Wo, kh * kw)
        arg = win.argmax(axis=-1)
        self._cache = (arg, x.shape)
        return xp.take_along_axis(win, arg[..., None], axis=-1)[..., 0]

    def backward(self, dy):
        xp = array_module(dy)
        arg, (N, C, H, W) = self._cache
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        Ho, Wo = dy.shape[2], dy.shape[3]
        dx = xp.zeros((N, C, H, W), dtype=dy.dtype)
        zero = dy.dtype.type(0)
        for i in range(kh):
            for j in range(kw):
                dx[:, :, i:i + sh * (Ho - 1) + 1:sh, j:j + sw * (Wo - 1) + 1:sw] += xp.where(
                    arg == i * kw + j, dy, zero)
        self._cache = None
        return dx

    def output_shape(self, in_shape):
        C, H, W = in_shape
        return (C, *self._out_hw(H, W))

    def __repr__(self):
        return f"MaxPool2d(kernel_size={self.kernel_size}, stride={self.stride})"


class GlobalAvgPool2d(Layer):
    """Mean over the spatial dimensions: ``(N, C, H, W) -> (N, C)``."""

    def forward(self, x, training: bool = True):
        if x.ndim != 4:
            raise ValueError(f"GlobalAvgPool2d expects (N, C, H, W), got {tuple(x.shape)}")
        self._shape = x.shape
        return x.mean(axis=(2, 3))

    def backward(self, dy):
        xp = array_module(dy)
        N, C, H, W = self._shape
        # channels-last, like the convolutions' outputs, so the block below needs no transpose
        g = xp.broadcast_to((dy / (H * W))[:, None, None, :], (N, H, W, C))
        return g.copy().transpose(0, 3, 1, 2)

    def output_shape(self, in_shape):
        return (in_shape[0],)


class Flatten(Layer):
    """``(N, d1, d2, ...) -> (N, d1*d2*...)``."""

    def forward(self, x, training: bool = True):
        self._shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        return dy.reshape(self._shape)

    def output_shape(self, in_shape):
        return (prod(in_shape),)


# ---------------------------------------------------------------------------------------------
# containers and residual blocks
# ---------------------------------------------------------------------------------------------
class Sequential(Layer):
    """Run children in order.

    Parameters
    ----------
    layers : sequence of Layer or of (name, Layer)
        Unnamed layers are named by their index.
    """

    def __init__(self, layers: Sequence):
        super().__init__()
        for idx, item in enumerate(layers):
            if isinstance(item, tuple):
                name, layer = item
            else:
                name, layer = str(idx), item
            self.add_child(name, layer)

    def forward(self, x, training: bool = True):
        for _, layer in self._children:
            x = layer.forward(x, training)
        return x

    def backward(self, dy):
        for _, layer in reversed(self._children):
            dy = layer.backward(dy)
        return dy

    def output_shape(self, in_shape):
        for _, layer in self._children:
            in_shape = layer.output_shape(in_shape)
        return in_shape

    def macs(self, in_shape):
        total = 0
        for _, layer in self._children:
            total += layer.macs(in_shape)
            in_shape = layer.output_shape(in_shape)
        return total

    def __repr__(self):
        inner = ",\n  ".join(f"({n}) {layer!r}".replace("\n", "\n  ")
                              for n, layer in self._children)
        return f"Sequential(\n  {inner}\n)"


def _sum(a, b):
    """``a + b`` (one parallel pass with the Numba kernels when both share a memory order)."""
    k = _numba_kernels(array_module(a))
    if k is not None and a.dtype == b.dtype and a.shape == b.shape:
        y = _empty_like_layout(a)
        flat = _flat_layout(a, b, y)
        if flat is not None:
            k.add(*flat)
            return y
    return a + b


class _Residual(Layer):
    """``relu(main(x) + shortcut(x))``; the shortcut is identity or 1x1 conv (stride) + BN.

    Children are registered main branch first, then the shortcut; backward runs the shortcut
    first, so gradients become ready in exactly the reverse of the registration order.
    """

    def _finish_init(self, main: list[tuple[str, Layer]], in_ch: int, out_ch: int, stride: int):
        for name, layer in main:
            self.add_child(name, layer)
        self._main = [layer for _, layer in main]
        self.projection = stride != 1 or in_ch != out_ch
        if self.projection:
            self.shortcut = self.add_child("shortcut", Sequential([
                ("conv", Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)),
                ("bn", BatchNorm2d(out_ch)),
            ]))
        self._relu = ReLU()

    def forward(self, x, training: bool = True):
        h = x
        for layer in self._main:
            h = layer.forward(h, training)
        s = self.shortcut.forward(x, training) if self.projection else x
        return self._relu.forward_sum(h, s, training)

    def backward(self, dy):
        d = self._relu.backward(dy)
        dx = self.shortcut.backward(d) if self.projection else d
        for layer in reversed(self._main):
            d = layer.backward(d)
        return _sum(dx, d)

    def output_shape(self, in_shape):
        for layer in self._main:
            in_shape = layer.output_shape(in_shape)
        return in_shape

    def macs(self, in_shape):
        total, shape = 0, in_shape
        for layer in self._main:
            total += layer.macs(shape)
            shape = layer.output_shape(shape)
        if self.projection:
            total += self.shortcut.macs(in_shape)
        return total


class BasicBlock(_Residual):
    """ResNet basic block: conv3x3(stride)-BN-ReLU-conv3x3-BN, plus shortcut, then ReLU.

    The shortcut is a 1x1 conv (with ``stride``) + BN when the shape changes
    (``stride != 1`` or ``in_channels != out_channels``), identity otherwise.
    """

    expansion = 1

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.in_channels, self.out_channels, self.stride = in_channels, out_channels, stride
        self._finish_init([
            ("conv1", Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)),
            ("bn1", BatchNorm2d(out_channels)),
            ("relu1", ReLU()),
            ("conv2", Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)),
            ("bn2", BatchNorm2d(out_channels)),
        ], in_channels, out_channels, stride)

    def __repr__(self):
        return f"BasicBlock({self.in_channels}, {self.out_channels}, stride={self.stride})"


class Bottleneck(_Residual):
    """ResNet bottleneck (v1.5: stride on the 3x3 conv): 1x1-BN-ReLU-3x3-BN-ReLU-1x1-BN + shortcut.

    Parameters
    ----------
    in_channels : int
    planes : int
        Output channels are ``planes * 4``.
    stride : int
    width : int, optional
        Inner width (default ``planes``; WideResNet-50-2 uses ``2 * planes``).
    """

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1, width: int | None = None):
        super().__init__()
        width = planes if width is None else int(width)
        out_ch = planes * self.expansion
        self.in_channels, self.out_channels, self.width, self.stride = (
            in_channels, out_ch, width, stride)
        self._finish_init([
            ("conv1", Conv2d(in_channels, width, 1, bias=False)),
            ("bn1", BatchNorm2d(width)),
            ("relu1", ReLU()),
            ("conv2", Conv2d(width, width, 3, stride=stride, padding=1, bias=False)),
            ("bn2", BatchNorm2d(width)),
            ("relu2", ReLU()),
            ("conv3", Conv2d(width, out_ch, 1, bias=False)),
            ("bn3", BatchNorm2d(out_ch)),
        ], in_channels, out_ch, stride)

    def __repr__(self):
        return (f"Bottleneck({self.in_channels}, {self.out_channels}, width={self.width}, "
                f"stride={self.stride})")


# ---------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------
#: logits with at least this many entries take the fused Numba pass once the kernels are loaded
CE_MIN_KERNEL = 1 << 16


def softmax_cross_entropy(logits, labels):
    """Mean softmax cross-entropy and its gradient with respect to the logits.

    Parameters
    ----------
    logits : array (N, K)
    labels : integer array (N,) with values in ``[0, K)``

    Returns
    -------
    loss : float
        ``mean_n [logsumexp(logits_n) - logits_n[labels_n]]``.
    dlogits : array (N, K)
        ``(softmax(logits) - onehot(labels)) / N``.
    """
    xp = array_module(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be (N, K), got shape {tuple(logits.shape)}")
    N, K = logits.shape
    if labels.shape != (N,):
        raise ValueError(f"labels must have shape ({N},), got {tuple(labels.shape)}")
    k = _numba_kernels(xp)
    if k is not None and logits.dtype.kind == "f" and N * K >= CE_MIN_KERNEL and N:
        # fused rows (a language model's N T x V logits): the same values to round-off
        return k.softmax_cross_entropy(np.ascontiguousarray(logits),
                                       np.ascontiguousarray(labels, dtype=np.int64))
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    sum_exp = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(N)
    log_p_true = shifted[rows, labels] - xp.log(sum_exp[:, 0])
    loss = float(-log_p_true.mean())
    grad = exp / sum_exp
    grad[rows, labels] -= 1.0
    grad /= N
    return loss, grad


class SoftmaxCrossEntropy:
    """Object form of :func:`softmax_cross_entropy`: ``forward`` returns the loss, ``backward``
    the logits gradient of the last call."""

    def forward(self, logits, labels) -> float:
        loss, self._grad = softmax_cross_entropy(logits, labels)
        return loss

    def backward(self):
        return self._grad
