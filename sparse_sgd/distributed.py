"""Distributed SpFF (Alg. 2) and SpBP (Alg. 3) on a row-partitioned sparse DNN.

Processor m stores, for every layer k, the row block W^k_m (split by :mod:`partition.maps` into
the columns it owns and the columns it receives), the bias entries b^k_m and its entries x^k_m.
Mini-batches are columns of X (§5.1), stored row-major ``(neurons, batch)`` so every message is a
contiguous block of rows.  All messages go through :class:`substrate.Comm` under the ledger
phases ``"spff"`` and ``"spbp"``.

Timeline (``clock=``, a :class:`substrate.clock.SimClock`): every block of Algs. 2-3 is a
compute event with its FLOP count; every message is declared by the send itself
(:meth:`substrate.comm.Comm.isend` with ``after=`` the compute event that produced its buffer:
one point-to-point event per message on the link to its peer, intra- or inter-node), so the
non-blocking messages overlap the local work the paper overlaps them with.  Per SpFF layer
``k``: ``spff_pack`` (line 4) -> one ``spff`` message per destination; ``spff_local`` (line 6,
``W_local x^{k-1}``) runs meanwhile; ``spff_remote`` (lines 8-10: remote product and activation)
waits for the local product and for the layer's messages.  Per SpBP layer ``k``:
``spbp_remote`` (the sent part of line 4) -> one ``spbp`` message per destination;
``spbp_local`` (the local part) and ``spbp_update`` (lines 8-9) run meanwhile; ``spbp_delta``
(lines 10-13) waits for the messages.  Receives are not declared: a rank's timeline holds only
its own events, and the rows it *receives* for layer ``k`` leave their senders at the same point
of the same schedule, so their arrival is stood in for by the completion of the messages this
rank sends for the layer (the senders book the bytes).  A node's ranks exchange a layer at the
same time over the node's one inter-node link, and every receiver waits for the busiest link of
the layer: each inter-node send carries the share of :meth:`sparse_sgd.plan.HSGDPlan.link_shares`
(:func:`substrate.calls.exchange_shares`: busiest link bytes / the rank's own inter-node bytes, R
for a node whose R ranks send alike), so that this rank's sends end when the exchange does on
its busiest link (the one-NIC rule alone, R, left the random-partition 8 x 2 and 16 x 1 wire-lab
runs 4-7 % short).  The next
layer's compute depends on its inputs only (the send buffers are per layer, so no send blocks
the next layer).  What the sends carry is :meth:`sparse_sgd.plan.HSGDPlan.calls`'s records,
message by message (the run accounts them).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import scipy.sparse as sp

from partition.maps import LayerMaps, build_maps
from partition.partitioners import Partition
from sparse_sgd.activations import ACTIVATIONS
from sparse_sgd.kernels import (
    challenge_finish_device,
    sddmm_update,
    sddmm_update_device,
    spmm_add,
    spmm_add_challenge,
)
from sparse_sgd.plan import PHASE_SPBP, PHASE_SPFF

__all__ = ["PHASE_SPBP", "PHASE_SPFF", "DistributedSparseNet"]

#: FLOPs per element of an activation or its derivative (the timeline's FLOP counts)
ACT_FLOPS = {"sigmoid": 4, "relu": 1}


class _Buffers:
    """Message buffers of one batch size, allocated once (plan once, run many)."""

    def __init__(self, maps: list[LayerMaps], B: int, dtype) -> None:
        self.xrecv = [np.empty((mp.recv_ptr[-1], B), dtype=dtype) for mp in maps]
        self.xsend = [[np.empty((ix.size, B), dtype=dtype) for ix in mp.send_index]
                      for mp in maps]
        self.srecv = [[np.empty((ix.size, B), dtype=dtype) for ix in mp.send_index]
                      for mp in maps]


class _DeviceLayer:
    """One layer's row block on the device: ``W_local`` / ``W_remote`` as CuPy CSR matrices
    (``cupyx.scipy.sparse``, cuSPARSE products), the row of every stored entry (the SDDMM
    update), the bias, and the send maps as device index arrays (built once)."""

    def __init__(self, mp: LayerMaps, bias: np.ndarray, xp) -> None:
        import cupyx.scipy.sparse as csp  # noqa: PLC0415  optional GPU backend

        self.Wl = csp.csr_matrix(mp.W_local)
        self.Wr = csp.csr_matrix(mp.W_remote)
        self.rows_l = xp.asarray(np.repeat(np.arange(mp.W_local.shape[0], dtype=np.int64),
                                           np.diff(mp.W_local.indptr)))
        self.rows_r = xp.asarray(np.repeat(np.arange(mp.W_remote.shape[0], dtype=np.int64),
                                           np.diff(mp.W_remote.indptr)))
        self.cols_l = self.Wl.indices
        self.cols_r = self.Wr.indices
        self.b = xp.asarray(bias)
        sizes = [int(ix.size) for ix in mp.send_index]
        self.send_ptr = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.send_all = xp.asarray(np.concatenate(mp.send_index).astype(np.int64)
                                   if sizes else np.zeros(0, dtype=np.int64))
        self.send_index = [xp.asarray(ix.astype(np.int64)) for ix in mp.send_index]
        self.recv_rows = int(mp.recv_ptr[-1])


class _DeviceBuffers:
    """Message buffers of one batch size on a GPU, allocated once: every layer's outgoing rows
    packed in one device block (one gather) and, for a host-only MPI, one pinned host block per
    direction, so a layer's messages cost one copy and one host wait, not one per message."""

    def __init__(self, layers: list[_DeviceLayer], B: int, dtype, backend, staged: bool):
        xp = backend.xp
        host = backend.pinned if staged else None
        self.xsend = [xp.empty((int(d.send_ptr[-1]), B), dtype=dtype) for d in layers]
        self.xrecv = [xp.empty((d.recv_rows, B), dtype=dtype) for d in layers]
        self.srecv = [xp.empty((int(d.send_ptr[-1]), B), dtype=dtype) for d in layers]
        if staged:
            self.xsend_h = [host((int(d.send_ptr[-1]), B), dtype) for d in layers]
            self.xrecv_h = [host((d.recv_rows, B), dtype) for d in layers]
            self.ssend_h = [host((d.recv_rows, B), dtype) for d in layers]
            self.srecv_h = [host((int(d.send_ptr[-1]), B), dtype) for d in layers]


class DistributedSparseNet:
    """One processor's part of a sparse DNN trained with SpFF + SpBP.

    Parameters
    ----------
    weights : list of scipy.sparse matrices
        The full W^1 .. W^L (every rank builds its plan from the full sparsity; values of the
        rows it owns are copied).
    partition : Partition
        Row partition with ``parts == comm.size``.
    comm : substrate.Comm
        Communicator of the processors (world).
    biases : list of np.ndarray, optional
        Full b^1 .. b^L (zeros if omitted).
    activation : str
        ``"sigmoid"`` (paper, §6.1) or ``"relu"``.
    dtype : numpy dtype
        Floating type of weights and activations.
    clock : substrate.clock.SimClock, optional
        Declare compute blocks as timeline events and send every message after the block
        that packed it (see the module docstring); without it the net does no timing of its
        own (its sends are then blocking calls in program order on the run's timeline).
    device : {"cpu", "gpu"}, optional
        Where the rows live; default: the communicator's backend (``--device``).  On a GPU
        the row blocks are CuPy CSR matrices (cuSPARSE SpMM), the SDDMM update and the
        activations CuPy array operations, and every layer's messages leave from one packed
        device block: the same plan, maps, messages (sizes, tags, order, ``after=``) and
        ledger as on the CPU, results equal within float round-off.  :meth:`forward` and
        :meth:`backward` accept host or device inputs; :attr:`X` is on the device, and
        :meth:`backward` returns the loss as a 0-d device array (read it when needed).
    link_shares : list, optional
        ``[spff, spbp]``, each per layer: the :attr:`substrate.calls.Call.share` of this rank's
        inter-node messages (:meth:`sparse_sgd.plan.HSGDPlan.link_shares`: every exchange ends
        on the timeline when its busiest node link does); default: the one-NIC rule.
    """

    def __init__(self, weights, partition: Partition, comm, *, biases=None,
                 activation: str = "sigmoid", dtype=np.float64, clock=None,
                 device: str | None = None, link_shares=None) -> None:
        if partition.parts != comm.size:
            raise ValueError(f"partition has {partition.parts} parts but the communicator has "
                             f"{comm.size} ranks; partition for {comm.size} processors")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.comm = comm
        self.rank = comm.rank
        self.dtype = np.dtype(dtype)
        self.f = ACTIVATIONS[activation]
        self.act_flops = ACT_FLOPS[activation]
        self.L = len(weights)
        if link_shares is None:
            link_shares = [[None] * self.L, [None] * self.L]
        if len(link_shares) != 2 or any(len(row) != self.L for row in link_shares):
            raise ValueError(f"link_shares must hold [spff, spbp] shares for each of the {self.L} "
                             "layers (HSGDPlan.link_shares)")
        self.link_shares = link_shares
        self.partition = partition
        self.maps = build_maps(weights, partition, comm.rank)  # Xsend/Xrecv, once
        for mp in self.maps:
            for M in (mp.W_local, mp.W_remote):
                M.data = M.data.astype(self.dtype)
                M.indices = M.indices.astype(np.int64)
                M.indptr = M.indptr.astype(np.int64)
        if biases is None:
            self.b = [np.zeros(mp.rows.size, dtype=self.dtype) for mp in self.maps]
        else:
            self.b = [np.asarray(b, dtype=self.dtype)[mp.rows].copy()
                      for b, mp in zip(biases, self.maps)]
        self._buffers: dict[int, _Buffers] = {}
        self.X: list = []
        self.delta: list = []
        self.clock = clock
        backend = comm.backend
        if device is None:
            device = "gpu" if backend.is_gpu else "cpu"
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be cpu or gpu, got {device!r}")
        if device == "gpu" and not backend.is_gpu:
            raise ValueError("device='gpu' needs the run's GPU backend (--device gpu)")
        self.gpu = device == "gpu"
        self.backend = backend
        self.xp = backend.xp if self.gpu else np
        if self.gpu:
            self._dev = [_DeviceLayer(mp, b, self.xp) for mp, b in zip(self.maps, self.b)]
            self._staged = not backend.cuda_aware
            self._fences: dict = {}
            self.b = [d.b for d in self._dev]

    # -- timeline --------------------------------------------------------------------------------
    @contextmanager
    def _compute(self, label: str, flops: float, deps=()):
        """A compute block of ``flops`` FLOPs after ``deps`` on the clock (nothing without
        one); :meth:`_last` is its event afterwards."""
        if self.clock is None:
            yield
            return
        with self.clock.compute(label, flops=float(flops), deps=deps):
            yield

    def _last(self):
        """The event of the last compute block (``None`` off the timeline)."""
        clock = self.clock
        return clock.last_event if clock is not None and clock.timeline is not None else None

    def _after(self):
        """``after=`` of a send posted right after the compute block that filled its buffer:
        that block's event (it overlaps what the rank computes next); ``None`` without a clock
        (a blocking call in program order)."""
        ev = self._last()
        return None if ev is None else [ev]

    # -- data layout ---------------------------------------------------------------------------
    @property
    def input_rows(self) -> np.ndarray:
        """Global indices of x^0_m."""
        return self.maps[0].prev_rows

    @property
    def output_rows(self) -> np.ndarray:
        """Global indices of x^L_m."""
        return self.maps[-1].rows

    def rows_of_layer(self, k: int) -> np.ndarray:
        """Global indices of x^k_m (k = 0..L)."""
        return self.maps[0].prev_rows if k == 0 else self.maps[k - 1].rows

    def local_weights(self, k: int) -> sp.coo_matrix:
        """W^k_m in global coordinates (for checks): a COO matrix of the full W^k shape."""
        self.pull_weights()
        mp = self.maps[k - 1]
        n_cols = self.partition.owners[k - 1].size
        parts = []
        for M, cols in ((mp.W_local, mp.prev_rows), (mp.W_remote, mp.recv_global)):
            c = M.tocoo()
            parts.append((mp.rows[c.row], cols[c.col], c.data))
        r, c, v = (np.concatenate(a) for a in zip(*parts))
        return sp.coo_matrix((v, (r, c)), shape=(self.partition.owners[k].size, n_cols))

    def _bufs(self, B: int) -> _Buffers:
        buf = self._buffers.get(B)
        if buf is None:
            buf = self._buffers[B] = (
                _DeviceBuffers(self._dev, B, self.dtype, self.backend, self._staged)
                if self.gpu else _Buffers(self.maps, B, self.dtype))
        return buf

    # -- device state (GPU) ----------------------------------------------------------------------
    def pull_weights(self) -> None:
        """Copy the device weights back into :attr:`maps` (checks, checkpoints; GPU only)."""
        if not self.gpu:
            return
        for mp, d in zip(self.maps, self._dev):
            mp.W_local.data[...] = d.Wl.data.get()
            mp.W_remote.data[...] = d.Wr.data.get()

    def push_weights(self) -> None:
        """Copy :attr:`maps`' weights (e.g. restored from a checkpoint) to the device."""
        if not self.gpu:
            return
        for mp, d in zip(self.maps, self._dev):
            d.Wl.data[...] = self.xp.asarray(mp.W_local.data)
            d.Wr.data[...] = self.xp.asarray(mp.W_remote.data)

    def host_biases(self) -> list:
        """b^k_m as NumPy arrays."""
        return [self.backend.asnumpy(b) if self.gpu else b for b in self.b]

    def class_scores(self, out_class, num_classes: int):
        """This rank's share of the class scores of the last :meth:`forward`: the sum of x^L
        over the output neurons of each class, shape ``(num_classes, batch)``, on the net's
        device (on the CPU exactly the ``numpy.add.at`` of the trainer)."""
        XL = self.X[-1]
        xp = self.xp
        scores = xp.zeros((num_classes, XL.shape[1]))
        if not self.gpu:
            np.add.at(scores, out_class, XL)
            return scores
        import cupyx  # noqa: PLC0415  optional GPU backend

        cupyx.scatter_add(scores, xp.asarray(out_class), XL.astype(scores.dtype))
        return scores

    # -- Alg. 2 --------------------------------------------------------------------------------
    def _post_recvs(self, k: int, buf: _Buffers, phase: str) -> list:
        """The receives of line 8 of Alg. 2 for layer ``k`` (tag k), posted first."""
        mp = self.maps[k - 1]
        recv = buf.xrecv[k - 1]
        return [self.comm.irecv(recv[mp.recv_ptr[i]:mp.recv_ptr[i + 1]], int(n), tag=k,
                                phase=phase)
                for i, n in enumerate(mp.recv_ranks)]

    def _pack(self, k: int, x_prev: np.ndarray, buf: _Buffers) -> None:
        """Line 4 of Alg. 2: update every x̄ with the entries of x^{k-1}_m its receiver uses."""
        mp = self.maps[k - 1]
        for ix, sbuf in zip(mp.send_index, buf.xsend[k - 1]):
            np.take(x_prev, ix, axis=0, out=sbuf)

    def _post_sends(self, k: int, buf: _Buffers, phase: str, after) -> list:
        """Line 5 of Alg. 2 (tag k): one non-blocking send per destination, after ``after``."""
        mp = self.maps[k - 1]
        return [self.comm.isend(sbuf, int(n), tag=k, phase=phase, after=after,
                                share=self._share(k))
                for n, sbuf in zip(mp.send_ranks, buf.xsend[k - 1])]

    def _share(self, tag: int):
        """The timeline share of the inter-node messages of tag ``tag`` (SpFF of layer k: k;
        SpBP of layer k: L + k)."""
        return self.link_shares[0][tag - 1] if tag <= self.L else \
            self.link_shares[1][tag - self.L - 1]

    def forward(self, X0: np.ndarray, phase: str = PHASE_SPFF) -> np.ndarray:
        """SpFF (Alg. 2) on a mini-batch: ``X0`` holds x^0_m, shape (len(input_rows), B).

        Returns x^L_m; keeps x^k_m and the received x̂^{k-1} for SpBP.  ``phase`` names the
        messages in the ledger (``"eval"`` for a held-out evaluation).
        """
        if self.gpu:
            return self._forward_gpu(X0, phase)
        X0 = np.ascontiguousarray(X0, dtype=self.dtype)
        if X0.ndim != 2 or X0.shape[0] != self.input_rows.size:
            raise ValueError(f"X0 must have shape ({self.input_rows.size}, batch) on rank "
                             f"{self.rank}, got {X0.shape}")
        B = X0.shape[1]
        buf = self._bufs(B)
        self.X = [X0]
        for k, mp in enumerate(self.maps, start=1):
            x_prev = self.X[-1]
            rreq = self._post_recvs(k, buf, phase)
            with self._compute(f"{phase}_pack[{k}]", sum(ix.size for ix in mp.send_index) * B):
                self._pack(k, x_prev, buf)
            sreq = self._post_sends(k, buf, phase, self._after())
            rows = mp.rows.size
            with self._compute(f"{phase}_local[{k}]", (2 * mp.W_local.nnz + rows) * B):
                z = mp.W_local @ x_prev  # line 6: local product overlaps the messages
                z += self.b[k - 1][:, None]
            local = self._last()
            self.comm.waitall(rreq)  # line 8
            with self._compute(f"{phase}_remote[{k}]",
                               (2 * mp.W_remote.nnz + self.act_flops * rows) * B,
                               deps=[local, *sreq]):
                if mp.recv_ptr[-1]:
                    z += mp.W_remote @ buf.xrecv[k - 1]  # line 9
                self.X.append(self.f.apply(np.ascontiguousarray(z, dtype=self.dtype)))  # l. 10
            self.comm.waitall(sreq)
        return self.X[-1]

    # -- Alg. 3 --------------------------------------------------------------------------------
    def backward(self, Y: np.ndarray, lr: float) -> float:
        """SpBP (Alg. 3) with the weight update, after :meth:`forward`.

        ``Y`` holds the targets of x^L_m, shape (len(output_rows), B).  Loss J = 1/(2B) sum of
        squared errors; returns this rank's share of it (sum over ranks = J).
        """
        if self.gpu:
            return self._backward_gpu(Y, lr)
        XL = self.X[-1]
        Y = np.asarray(Y, dtype=self.dtype)
        if Y.shape != XL.shape:
            raise ValueError(f"Y must have shape {XL.shape} on rank {self.rank}, got {Y.shape}")
        B = XL.shape[1]
        buf = self._bufs(B)
        with self._compute("spbp_output", (4 + self.act_flops) * XL.size):
            loss = float(0.5 * np.sum((XL - Y) ** 2) / B)
            delta = np.ascontiguousarray((XL - Y) / B * self.f.derivative(XL))  # line 2, eq. 6
        self.delta = [None] * (self.L + 1)
        self.delta[self.L] = delta
        for k in range(self.L, 0, -1):
            mp = self.maps[k - 1]
            x_prev = self.X[k - 1]
            xrecv = buf.xrecv[k - 1]
            tag = self.L + k
            exchange = k > 1  # s^1 would only give delta^0: nothing to send
            if exchange:
                rreq = [self.comm.irecv(rb, int(n), tag=tag, phase=PHASE_SPBP)
                        for n, rb in zip(mp.send_ranks, buf.srecv[k - 1])]
                with self._compute(f"spbp_remote[{k}]", 2 * mp.W_remote.nnz * B):
                    s_remote = np.ascontiguousarray(mp.W_remote.T @ delta)  # line 4, sent part
                after = self._after()
                sreq = [self.comm.isend(s_remote[mp.recv_ptr[i]:mp.recv_ptr[i + 1]], int(n),
                                        tag=tag, phase=PHASE_SPBP, after=after,
                                        share=self._share(tag))
                        for i, n in enumerate(mp.recv_ranks)]  # lines 5-7 (Ssend = Xrecv rows)
                with self._compute(f"spbp_local[{k}]", 2 * mp.W_local.nnz * B):
                    s = np.asarray(mp.W_local.T @ delta)  # line 4, local part
            # lines 8-9: outer-product update on the sparsity, overlapped with the messages
            with self._compute(f"spbp_update[{k}]",
                               2 * (mp.W_local.nnz + mp.W_remote.nnz) * B + 2 * delta.size):
                sddmm_update(mp.W_local.indptr, mp.W_local.indices, mp.W_local.data, delta,
                             x_prev, lr)
                if mp.recv_ptr[-1]:
                    sddmm_update(mp.W_remote.indptr, mp.W_remote.indices, mp.W_remote.data,
                                 delta, xrecv, lr)
                self.b[k - 1] -= lr * delta.sum(axis=1)
            if exchange:
                self.comm.waitall(rreq)  # lines 10-12
                received = sum(ix.size for ix in mp.send_index) * B
                with self._compute(f"spbp_delta[{k}]",
                                   received + (1 + self.act_flops) * x_prev.size,
                                   deps=[self._last(), *sreq]):
                    for ix, rb in zip(mp.send_index, buf.srecv[k - 1]):
                        s[ix] += rb
                    delta = np.ascontiguousarray(s * self.f.derivative(x_prev))  # line 13
                self.delta[k - 1] = delta
                self.comm.waitall(sreq)
        return loss

    def step(self, X0: np.ndarray, Y: np.ndarray, lr: float) -> float:
        """One SGD iteration (SpFF then SpBP); returns this rank's share of the loss."""
        self.forward(X0)
        return self.backward(Y, lr)

    # -- H-SpFF inference (§6.3) -----------------------------------------------------------------
    def infer_challenge(self, X0: np.ndarray, bias: float, ymax: float) -> np.ndarray:
        """H-SpFF with Graph Challenge semantics: x^k = min(max(W^k x^{k-1} + b, 0), ymax).

        The bias is added only where W^k x^{k-1} != 0; local and remote products use the fused
        Numba kernels.  ``X0`` is x^0_m for a batch, shape (len(input_rows), B).
        """
        if self.gpu:
            return self._infer_gpu(X0, bias, ymax)
        X0 = np.ascontiguousarray(X0, dtype=self.dtype)
        B = X0.shape[1]
        buf = self._bufs(B)
        x_prev = X0
        for k, mp in enumerate(self.maps, start=1):
            rows = mp.rows.size
            rreq = self._post_recvs(k, buf, PHASE_SPFF)
            with self._compute(f"infer_pack[{k}]", sum(ix.size for ix in mp.send_index) * B):
                self._pack(k, x_prev, buf)
            sreq = self._post_sends(k, buf, PHASE_SPFF, self._after())
            with self._compute(f"infer_local[{k}]", 2 * mp.W_local.nnz * B):
                z = np.zeros((rows, B), dtype=self.dtype)
                spmm_add(mp.W_local.indptr, mp.W_local.indices, mp.W_local.data, x_prev, z)
            local = self._last()
            self.comm.waitall(rreq)
            with self._compute(f"infer_remote[{k}]", (2 * mp.W_remote.nnz + 3 * rows) * B,
                               deps=[local, *sreq]):
                spmm_add_challenge(mp.W_remote.indptr, mp.W_remote.indices, mp.W_remote.data,
                                   buf.xrecv[k - 1], z, self.dtype.type(bias),
                                   self.dtype.type(ymax))
            self.comm.waitall(sreq)
            x_prev = z
        return x_prev

    # -- the GPU path --------------------------------------------------------------------------
    # The same calls as the CPU path in the same order (receives posted first, sends after
    # the block that packed them, waits where Alg. 2/3 wait), so the plan's records, the
    # ledger and the timeline are the CPU run's.  A layer's outgoing rows are gathered into
    # one device block; with a host-only MPI that block is copied to pinned memory once
    # (one host wait per layer and direction: the data MPI must read) and the messages are
    # its row ranges; received rows are copied up once per layer, the compute stream waiting
    # for the copy without a host wait.

    def _device_input(self, A, rows: int, what: str):
        xp = self.xp
        A = xp.ascontiguousarray(xp.asarray(A, dtype=self.dtype))
        if A.ndim != 2 or A.shape[0] != rows:
            raise ValueError(f"{what} must have shape ({rows}, batch) on rank {self.rank}, "
                             f"got {A.shape}")
        return A

    def _post_recvs_gpu(self, tag: int, phase: str, into_dev, into_host, ptr, ranks) -> list:
        """Receives (``tag``) into the row blocks ``ptr`` of the pinned host block (host-only
        MPI: once the copy up of its previous contents has run) or of the device block
        (CUDA-aware: posted after the layer's sends, whose host wait covers the kernels that
        read the block before)."""
        if self._staged:
            fence = self._fences.pop(id(into_host), None)
            if fence is not None and not self.backend._fence_done(fence):
                self.backend._fence_wait(fence)
            dst = into_host
        else:
            dst = into_dev
        return [self.comm.irecv(dst[ptr[i]:ptr[i + 1]], int(n), tag=tag, phase=phase)
                for i, n in enumerate(ranks)]

    def _send_gpu(self, dev_block, host_block, ptr, ranks, tag: int, phase: str, after):
        """The packed block to MPI with one host wait (host-only MPI: one copy to pinned
        memory; CUDA-aware: the device memory once its kernels completed), then one send per
        destination of its row range ``ptr[i]:ptr[i+1]``."""
        if self._staged:
            if dev_block.size:
                self.backend.to_host(dev_block, host_block,
                                     after=self.xp.cuda.get_current_stream().record())
            src = host_block
        else:
            if dev_block.size:
                self.backend.synchronize()
            src = dev_block
        return [self.comm.isend(src[ptr[i]:ptr[i + 1]], int(n), tag=tag, phase=phase,
                                after=after, share=self._share(tag))
                for i, n in enumerate(ranks)]

    def _arrived(self, dev_block, host_block) -> None:
        """The received rows on the device (host-only MPI: one copy up, no host wait; the
        copy fences the host block's next receive)."""
        if self._staged and dev_block.size:
            self._fences[id(host_block)] = self.backend.to_device(host_block, dev_block)

    def _recvs_ff(self, k: int, phase: str, buf, mp: LayerMaps, before: bool) -> list:
        """SpFF receives of layer ``k``: before the pack on a host-only MPI (as Alg. 2),
        after the sends with a CUDA-aware one (:meth:`_post_recvs_gpu`)."""
        if before != self._staged:
            return []
        return self._post_recvs_gpu(k, phase, buf.xrecv[k - 1],
                                    buf.xrecv_h[k - 1] if self._staged else None,
                                    mp.recv_ptr, mp.recv_ranks)

    def _spff_exchange_gpu(self, k, mp, d, x_prev, buf, phase: str, label: str, B: int):
        """Layer ``k``'s SpFF exchange on the device (training and inference alike): the
        receives posted (before the pack where the plan says so), the rows the peers need
        gathered into one device block (compute ``{label}_pack[k]``) and sent, the remaining
        receives posted.  Returns ``(receive requests, send requests)``."""
        rreq = self._recvs_ff(k, phase, buf, mp, before=True)
        with self._compute(f"{label}_pack[{k}]", sum(ix.size for ix in mp.send_index) * B):
            if d.send_all.size:
                self.xp.take(x_prev, d.send_all, axis=0, out=buf.xsend[k - 1])
        sreq = self._send_gpu(buf.xsend[k - 1], buf.xsend_h[k - 1] if self._staged else None,
                              d.send_ptr, mp.send_ranks, k, phase, self._after())
        return rreq or self._recvs_ff(k, phase, buf, mp, before=False), sreq

    def _forward_gpu(self, X0, phase: str):
        X0 = self._device_input(X0, self.input_rows.size, "X0")
        B = X0.shape[1]
        buf = self._bufs(B)
        self.X = [X0]
        for k, (mp, d) in enumerate(zip(self.maps, self._dev), start=1):
            x_prev = self.X[-1]
            rreq, sreq = self._spff_exchange_gpu(k, mp, d, x_prev, buf, phase, phase, B)
            rows = mp.rows.size
            with self._compute(f"{phase}_local[{k}]", (2 * mp.W_local.nnz + rows) * B):
                z = d.Wl @ x_prev  # line 6: local product overlaps the messages
                z += d.b[:, None]
            local = self._last()
            self.comm.waitall(rreq)  # line 8
            self._arrived(buf.xrecv[k - 1], buf.xrecv_h[k - 1] if self._staged else None)
            with self._compute(f"{phase}_remote[{k}]",
                               (2 * mp.W_remote.nnz + self.act_flops * rows) * B,
                               deps=[local, *sreq]):
                if mp.recv_ptr[-1]:
                    z += d.Wr @ buf.xrecv[k - 1]  # line 9
                self.X.append(self.f.apply(self.xp.ascontiguousarray(z, dtype=self.dtype)))
            self.comm.waitall(sreq)
        return self.X[-1]

    def _backward_gpu(self, Y, lr: float):
        xp = self.xp
        XL = self.X[-1]
        Y = self._device_input(Y, XL.shape[0], "Y")
        if Y.shape != XL.shape:
            raise ValueError(f"Y must have shape {XL.shape} on rank {self.rank}, got {Y.shape}")
        B = XL.shape[1]
        buf = self._bufs(B)
        with self._compute("spbp_output", (4 + self.act_flops) * XL.size):
            loss = 0.5 * xp.sum((XL - Y) ** 2) / B            # stays on the device
            delta = xp.ascontiguousarray((XL - Y) / B * self.f.derivative(XL))
        self.delta = [None] * (self.L + 1)
        self.delta[self.L] = delta
        for k in range(self.L, 0, -1):
            mp, d = self.maps[k - 1], self._dev[k - 1]
            x_prev = self.X[k - 1]
            tag = self.L + k
            exchange = k > 1
            if exchange:
                post = lambda tag=tag, k=k, d=d, mp=mp: self._post_recvs_gpu(  # noqa: E731
                    tag, PHASE_SPBP, buf.srecv[k - 1],
                    buf.srecv_h[k - 1] if self._staged else None, d.send_ptr, mp.send_ranks)
                rreq = post() if self._staged else None
                with self._compute(f"spbp_remote[{k}]", 2 * mp.W_remote.nnz * B):
                    s_remote = xp.ascontiguousarray(d.Wr.T @ delta)  # line 4, sent part
                sreq = self._send_gpu(s_remote, buf.ssend_h[k - 1] if self._staged else None,
                                      mp.recv_ptr, mp.recv_ranks, tag, PHASE_SPBP,
                                      self._after())
                if rreq is None:
                    rreq = post()
                with self._compute(f"spbp_local[{k}]", 2 * mp.W_local.nnz * B):
                    s = d.Wl.T @ delta  # line 4, local part
            with self._compute(f"spbp_update[{k}]",
                               2 * (mp.W_local.nnz + mp.W_remote.nnz) * B + 2 * delta.size):
                sddmm_update_device(d.rows_l, d.cols_l, d.Wl.data, delta, x_prev, lr)
                if mp.recv_ptr[-1]:
                    sddmm_update_device(d.rows_r, d.cols_r, d.Wr.data, delta, buf.xrecv[k - 1],
                                        lr)
                d.b -= lr * delta.sum(axis=1)
            if exchange:
                self.comm.waitall(rreq)  # lines 10-12
                self._arrived(buf.srecv[k - 1], buf.srecv_h[k - 1] if self._staged else None)
                received = sum(ix.size for ix in mp.send_index) * B
                with self._compute(f"spbp_delta[{k}]",
                                   received + (1 + self.act_flops) * x_prev.size,
                                   deps=[self._last(), *sreq]):
                    for i, ix in enumerate(d.send_index):   # per source: the CPU's order
                        s[ix] += buf.srecv[k - 1][d.send_ptr[i]:d.send_ptr[i + 1]]
                    delta = xp.ascontiguousarray(s * self.f.derivative(x_prev))  # line 13
                self.delta[k - 1] = delta
                self.comm.waitall(sreq)
        return loss

    def _infer_gpu(self, X0, bias: float, ymax: float):
        X0 = self._device_input(X0, self.input_rows.size, "X0")
        B = X0.shape[1]
        buf = self._bufs(B)
        x_prev = X0
        for k, (mp, d) in enumerate(zip(self.maps, self._dev), start=1):
            rows = mp.rows.size
            rreq, sreq = self._spff_exchange_gpu(k, mp, d, x_prev, buf, PHASE_SPFF, "infer",
                                                 B)
            with self._compute(f"infer_local[{k}]", 2 * mp.W_local.nnz * B):
                z = d.Wl @ x_prev
            local = self._last()
            self.comm.waitall(rreq)
            self._arrived(buf.xrecv[k - 1], buf.xrecv_h[k - 1] if self._staged else None)
            with self._compute(f"infer_remote[{k}]", (2 * mp.W_remote.nnz + 3 * rows) * B,
                               deps=[local, *sreq]):
                if mp.recv_ptr[-1]:
                    z += d.Wr @ buf.xrecv[k - 1]
                challenge_finish_device(z, self.dtype.type(bias), self.dtype.type(ymax))
            self.comm.waitall(sreq)
            x_prev = z
        return x_prev
