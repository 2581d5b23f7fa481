"""2-D convolution (:class:`Conv2d`): channels-last im2col + one GEMM, blocked images, and
Winograd F(2x2, 3x3).

The direct path is ``Y = im2col(X) W_mat^T`` (one GEMM, the convolution as a matrix product of
Chellapilla et al. 2006), its adjoint ``dW = dY^T cols`` and ``dX`` as a stride-1 convolution
with the flipped kernel or ``col2im(dY W_mat)``; thin GEMMs run on cache-sized blocks of
images (:data:`BLOCK_ROWS`).  3x3 stride-1 convolutions with enough channels take Winograd's
minimal filtering F(2x2, 3x3) (Lavin & Gray 2016, eq. 8: ``Y = A^T [(G g G^T) ⊙ (B^T d B)]
A`` per 2x2 output tile, 16 multiplications per tile and channel pair instead of 36), with
the transforms in :mod:`models.kernels_winograd`.  The data movement is in
:mod:`models.im2col`; the layer conventions in :mod:`models.layers`.
"""

from __future__ import annotations

import numpy as np

from substrate.backend import array_module

from .im2col import Workspace, col2im_nhwc, conv_output_size, im2col_nhwc
from .im2col import transient as _transient
from .kernel_loader import numba_kernels as _numba_kernels
from .layer_base import Layer, _channel_sum, _copy, _matmul, _pair

__all__ = [
    "BLOCK_MAX_COUT",
    "BLOCK_MIN_BLOCKS",
    "BLOCK_ROWS",
    "WINOGRAD_MIN_CHANNELS",
    "WINOGRAD_MIN_HW",
    "WINOGRAD_TILES",
    "Conv2d",
]

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

    def _wino_conv(self, k, Xp, U, bias, Y, tag: str, order) -> None:
        """``Y`` (N, H, W, K) = the 3x3 stride-1 padding-1 convolution of the image whose
        zero-padded copy is ``Xp`` (N, H+2, W+2, C), with the transformed kernel ``U``
        (16, C, K, its products in ``order``), block of images by block: input transform,
        16 GEMMs ``M[e] = V[e] U[e]``, output transform (+ bias)."""
        N, H, W, C = Xp.shape[0], Xp.shape[1] - 2, Xp.shape[2] - 2, Xp.shape[3]
        P, K = (H // 2) * (W // 2), U.shape[2]
        for n0, n1 in self._wino_blocks(N, H, W):
            T = (n1 - n0) * P
            V = _transient(f"wino_v{tag}", (16, T, C), Xp.dtype, np)
            M = _transient(f"wino_m{tag}", (16, T, K), Xp.dtype, np)
            k.winograd_input(Xp, n0, n1, V, order)
            _matmul(V, U, out=M)
            k.winograd_output(M, n0, bias, Y, order)

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
        self._wino_conv(k, Xp, U, self.P["bias"] if self.bias else None, Y, "f", k.IDENTITY)
        self._cache = (Xp, (N, H, W, C), (H, W), "winograd")
        return Y.transpose(0, 3, 1, 2)

    def _backward_winograd(self, Xp, dyl):
        """``dW`` as the adjoint of the Winograd forward (``dU[e] = Σ_blocks V[e]^T dM[e]``
        with ``dM`` the adjoint output transform of ``dY``, then ``dW = G^T dU G``), announced;
        then ``dX`` as the Winograd convolution of ``dY`` with the kernel turned by 180 degrees
        and its channels swapped: the forward's ``U`` transposed, in the
        :data:`~models.kernels_winograd.TURNED` order (no second weight transform)."""
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
        U = self._ws.get("wino_u", (16, C, c_out), dtype, np)     # the forward's
        dYp = _transient("wino_dypad", (N, H + 2, W + 2, c_out), dtype, np)
        k.pad1(dyl, dYp)
        dX = np.empty((N, H, W, C), dtype=dtype)
        self._wino_conv(k, dYp, U.transpose(0, 2, 1), None, dX, "b", k.TURNED)
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
