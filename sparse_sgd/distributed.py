"""Distributed SpFF (Alg. 2) and SpBP (Alg. 3) on a row-partitioned sparse DNN.

Processor m stores, for every layer k, the row block W^k_m (split by :mod:`partition.maps` into
the columns it owns and the columns it receives), the bias entries b^k_m and its entries x^k_m.
Mini-batches are columns of X (§5.1), stored row-major ``(neurons, batch)`` so every message is a
contiguous block of rows.

The net issues no call itself: every pass is a program generated from the plan's records
(:mod:`sparse_sgd.program`: per layer the receives, the sends, the local and remote products as
compute blocks and the waits of Algs. 2-3) and run by the one executor
(:class:`substrate.executor.Executor`).  The net is what the program is bound to
(:class:`substrate.executor.Bindings`): the maps' buffers each message is sent from
(:meth:`buffer`) and received into (:meth:`receive_buffer`), the SpMM/SDDMM compute of each
block (:meth:`compute`) and its FLOP count (:meth:`flops`).  A trainer runs the net's blocks
inside its own programs (a step, the evaluation, inference: :mod:`sparse_sgd.cli`) after
:meth:`feed` and :meth:`target`; :meth:`forward`, :meth:`backward` and
:meth:`infer_challenge` run one pass alone.

Simulated time: every block of Algs. 2-3 is a compute block of the program with its FLOP
count and every message a send of its own after the block that filled its buffer, so the job
simulation (:mod:`simulation.jobsim`) moves the non-blocking messages on the node's links while
the local work the paper overlaps them with runs; a receiver waits for its own receives.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import scipy.sparse as sp

from partition.maps import LayerMaps, build_maps
from partition.partitioners import Partition
from sparse_sgd.activations import ACT_FLOPS, ACTIVATIONS
from sparse_sgd.kernels import (
    challenge_finish_device,
    sddmm_update,
    sddmm_update_device,
    spmm_add,
    spmm_add_challenge,
)
from sparse_sgd.plan import PHASE_EVAL, PHASE_SPBP, PHASE_SPFF, HSGDPlan
from sparse_sgd.program import (
    BACKWARD,
    DELTA,
    INFER,
    LOCAL,
    OUTPUT,
    PACK,
    REMOTE,
    UPDATE,
    block_label,
    layer_of,
    pass_program,
)
from substrate.executor import Bindings, Executor

__all__ = ["PHASE_SPBP", "PHASE_SPFF", "DistributedSparseNet"]


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


class DistributedSparseNet(Bindings):
    """One processor's part of a sparse DNN trained with SpFF + SpBP.

    Parameters
    ----------
    weights : list of scipy.sparse matrices
        The full W^1 .. W^L (every rank builds its maps from the full sparsity; values of the
        rows it owns are copied).
    partition : Partition
        Row partition with ``parts`` = the run's world size.
    run : runner.run.Run
        The run (its world communicator, clock, recorder and placement).
    plan : HSGDPlan, optional
        The partition's plan (built from ``partition`` if omitted): the records the net's
        own passes are generated from.
    biases : list of np.ndarray, optional
        Full b^1 .. b^L (zeros if omitted).
    activation : str
        ``"sigmoid"`` (paper, §6.1) or ``"relu"``.
    dtype : numpy dtype
        Floating type of weights and activations.
    device : {"cpu", "gpu"}, optional
        Where the rows live; default: the communicator's backend (``--device``).  On a GPU
        the row blocks are CuPy CSR matrices (cuSPARSE SpMM), the SDDMM update and the
        activations CuPy array operations, and every layer's messages leave from one packed
        device block: the same plan, maps, messages (sizes, tags, order) and ledger as on the
        CPU, results equal within float round-off.  :meth:`forward` and :meth:`backward`
        accept host or device inputs; :attr:`X` is on the device, and :meth:`backward`
        returns the loss as a 0-d device array (read it when needed).
    executor : substrate.executor.Executor, optional
        The run's executor (a new one if omitted).
    """

    def __init__(self, weights, partition: Partition, run, *, plan: HSGDPlan | None = None,
                 biases=None, activation: str = "sigmoid", dtype=np.float64,
                 device: str | None = None, executor: Executor | None = None) -> None:
        comm = run.world
        if partition.parts != comm.size:
            raise ValueError(f"partition has {partition.parts} parts but the communicator has "
                             f"{comm.size} ranks; partition for {comm.size} processors")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.run = run
        self.rank = comm.rank
        self.placement = run.topo.placement
        self.dtype = np.dtype(dtype)
        self.f = ACTIVATIONS[activation]
        self.act_flops = ACT_FLOPS[activation]
        self.L = len(weights)
        self.partition = partition
        self.plan = plan if plan is not None else HSGDPlan.from_partition(weights, partition)
        self.executor = executor if executor is not None else Executor(run)
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
        # position of each peer in a layer's maps: SpFF receives from recv_ranks and sends to
        # send_ranks; SpBP the other way round
        self._recv_at = [{int(n): i for i, n in enumerate(mp.recv_ranks)} for mp in self.maps]
        self._send_at = [{int(n): i for i, n in enumerate(mp.send_ranks)} for mp in self.maps]
        self._sent_rows = [sum(int(ix.size) for ix in mp.send_index) for mp in self.maps]
        self._buffers: dict[int, _Buffers] = {}
        self._programs: dict = {}
        #: x^0 .. x^k of the pass (x^k_m, k = 0..L after a forward) and delta^k (SpBP)
        self.X: list = []
        self.delta: list = []
        #: this rank's share of the last SpBP's loss J
        self.loss = None
        self._x = None             # x^{k-1} of an inference pass
        self._z = None             # layer k's product between its local and remote blocks
        self._s = None             # SpBP: the local part of s^{k-1}
        self._s_remote = None      # SpBP: the part sent
        self._Y = None
        self.lr = None
        self._challenge = (self.dtype.type(0), self.dtype.type(0))
        self._B = None
        self._buf = None
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
        self._staged = False
        if self.gpu:
            self._dev = [_DeviceLayer(mp, b, self.xp) for mp, b in zip(self.maps, self.b)]
            self._staged = not backend.cuda_aware
            self._fences: dict = {}
            self.b = [d.b for d in self._dev]
        #: a layer's receives are posted before its pack (Alg. 2), except on a GPU with a
        #: CUDA-aware MPI: after its sends, whose host wait covers the kernels that read the
        #: device block they land in
        self.receives_first = not (self.gpu and not self._staged)
        #: GPU: the exchange whose packed block has not gone to MPI yet (its first send takes
        #: it there: one copy and one host wait per layer and direction)
        self._unsent = None
        self._blocks = self._block_table()

    # -- data layout ---------------------------------------------------------------------------
    @property
    def input_rows(self) -> np.ndarray:
        """Global indices of x^0_m."""
        return self.maps[0].prev_rows

    @property
    def output_rows(self) -> np.ndarray:
        """Global indices of x^L_m."""
        return self.maps[-1].rows

    @property
    def x(self):
        """x^L_m of the last inference pass (:meth:`infer_challenge`; x^k_m while it runs)."""
        return self._x

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

    # -- a pass's inputs ---------------------------------------------------------------------------
    def feed(self, X0) -> None:
        """``X0``, x^0_m of a batch, shape (len(input_rows), B): the input of the next pass (on
        a GPU staged to the device)."""
        if self.gpu:
            X0 = self._device_input(X0, self.input_rows.size, "X0")
        else:
            X0 = np.ascontiguousarray(X0, dtype=self.dtype)
            if X0.ndim != 2 or X0.shape[0] != self.input_rows.size:
                raise ValueError(f"X0 must have shape ({self.input_rows.size}, batch) on rank "
                                 f"{self.rank}, got {X0.shape}")
        self._B = X0.shape[1]
        self._buf = self._bufs(self._B)
        self.X = [X0]
        self._x = X0

    def target(self, Y, lr: float) -> None:
        """``Y``, the targets of x^L_m for the fed batch, shape (len(output_rows), B), and the
        learning rate of the next SpBP."""
        shape = (self.output_rows.size, self._B)
        if self.gpu:
            Y = self._device_input(Y, shape[0], "Y")
        else:
            Y = np.asarray(Y, dtype=self.dtype)
        if Y.shape != shape:
            raise ValueError(f"Y must have shape {shape} on rank {self.rank}, got {Y.shape}")
        self._Y, self.lr = Y, lr

    def set_challenge(self, bias: float, ymax: float) -> None:
        """The Graph Challenge bias and activation cap of inference (§6.3)."""
        self._challenge = (self.dtype.type(bias), self.dtype.type(ymax))

    # -- one pass alone ----------------------------------------------------------------------------
    def forward(self, X0) -> np.ndarray:
        """SpFF (Alg. 2) on a mini-batch: ``X0`` holds x^0_m, shape (len(input_rows), B).

        Returns x^L_m; keeps x^k_m and the received x̂^{k-1} for SpBP."""
        self.feed(X0)
        self._run(PHASE_SPFF)
        return self.X[-1]

    def backward(self, Y, lr: float):
        """SpBP (Alg. 3) with the weight update, after :meth:`forward`.

        ``Y`` holds the targets of x^L_m, shape (len(output_rows), B).  Loss J = 1/(2B) sum of
        squared errors; returns this rank's share of it (sum over ranks = J).
        """
        self.target(Y, lr)
        self._run(BACKWARD)
        return self.loss

    def step(self, X0, Y, lr: float):
        """One SGD iteration (SpFF then SpBP); returns this rank's share of the loss."""
        self.forward(X0)
        return self.backward(Y, lr)

    def infer_challenge(self, X0, bias: float, ymax: float):
        """H-SpFF with Graph Challenge semantics (§6.3): x^k = min(max(W^k x^{k-1} + b, 0),
        ymax), the bias added only where W^k x^{k-1} != 0; local and remote products use the
        fused Numba kernels.  ``X0`` is x^0_m for a batch, shape (len(input_rows), B)."""
        self.feed(X0)
        self.set_challenge(bias, ymax)
        self._run(INFER)
        return self._x

    def _run(self, prefix: str) -> None:
        """Run one pass (:func:`sparse_sgd.program.pass_program`) on the fed batch: SpFF with
        the blocks' ``prefix`` (``spff``, ``infer``) or SpBP (``spbp``)."""
        B, overlap = self._B, self.run.recorder.overlap
        key = (prefix, B, overlap)
        program = self._programs.get(key)
        if program is None:
            interval, samples = ("infer", B) if prefix == INFER else ("step", 0)
            records = self.plan.tagged_calls(self.placement, B, self.dtype.itemsize, interval,
                                             samples=samples)
            program = self._programs[key] = pass_program(
                records, self.L, self.placement, self.rank, prefix, overlap=overlap,
                receives_first=self.receives_first)
        self.executor.run_step(program, self)

    # -- what the programs are bound to --------------------------------------------------------------
    def compute(self, label: str):
        """The compute of block ``label`` (one of :mod:`sparse_sgd.program`'s layer blocks)."""
        try:
            return self._blocks[label][0]
        except KeyError:
            return super().compute(label)

    def flops(self, label: str) -> float | None:
        entry = self._blocks.get(label)
        return None if entry is None else float(entry[1]())

    def buffer(self, call):
        """The rows a message carries (its label names the layer k, its destination the
        block): SpFF x^{k-1} rows packed for the receiver; SpBP the receiver's rows of
        ``W^k_remote^T delta^k``."""
        if call.algorithm != "p2p":
            return super().buffer(call)
        k, dst = layer_of(call), int(call.pairs[0, 1])
        mp, buf = self.maps[k - 1], self._buf
        if call.phase == PHASE_SPBP:                 # lines 5-7 of Alg. 3: Ssend = Xrecv rows
            i, ptr = self._recv_at[k - 1][dst], mp.recv_ptr
            if not self.gpu:
                return self._s_remote[ptr[i]:ptr[i + 1]]
            src = self._to_mpi((1, k), self._s_remote,
                               buf.ssend_h[k - 1] if self._staged else None)
            return src[ptr[i]:ptr[i + 1]]
        i = self._send_at[k - 1][dst]                # line 5 of Alg. 2
        if not self.gpu:
            return buf.xsend[k - 1][i]
        ptr = self._dev[k - 1].send_ptr
        src = self._to_mpi((0, k), buf.xsend[k - 1], buf.xsend_h[k - 1] if self._staged else None)
        return src[ptr[i]:ptr[i + 1]]

    def receive_buffer(self, source: int, nbytes: int, tag: int):
        """Where a message lands (``tag`` k: SpFF of layer k, line 8 of Alg. 2, the rows of
        x̂^{k-1} from ``source``; ``L + k``: SpBP of layer k, lines 10-12 of Alg. 3, the
        partial sums of the rows this rank sent it)."""
        backward = tag > self.L
        k = tag - self.L if backward else tag
        mp, buf = self.maps[k - 1], self._buf
        if backward:
            i = self._send_at[k - 1][int(source)]
            if not self.gpu:
                return buf.srecv[k - 1][i]
            ptr = self._dev[k - 1].send_ptr
            dst = self._landing(buf.srecv[k - 1], buf.srecv_h[k - 1] if self._staged else None)
        else:
            i, ptr = self._recv_at[k - 1][int(source)], mp.recv_ptr
            if not self.gpu:
                return buf.xrecv[k - 1][ptr[i]:ptr[i + 1]]
            dst = self._landing(buf.xrecv[k - 1], buf.xrecv_h[k - 1] if self._staged else None)
        return dst[ptr[i]:ptr[i + 1]]

    def _block_table(self) -> dict:
        """``{label: (compute, FLOPs)}`` of every block of the net's passes."""
        act = self.act_flops
        B = lambda: self._B  # noqa: E731
        table = {}
        for k, mp in enumerate(self.maps, start=1):
            rows, nl, nr = mp.rows.size, mp.W_local.nnz, mp.W_remote.nnz
            sent = self._sent_rows[k - 1]
            for prefix in (PHASE_SPFF, PHASE_EVAL, INFER):
                table[block_label(prefix, PACK, k)] = (
                    partial(self._pack, k, prefix == INFER), lambda s=sent: s * B())
            for prefix in (PHASE_SPFF, PHASE_EVAL):
                table[block_label(prefix, LOCAL, k)] = (
                    partial(self._local, k), lambda n=nl, r=rows: (2 * n + r) * B())
                table[block_label(prefix, REMOTE, k)] = (
                    partial(self._remote, k), lambda n=nr, r=rows: (2 * n + act * r) * B())
            table[block_label(INFER, LOCAL, k)] = (partial(self._challenge_local, k),
                                                   lambda n=nl: 2 * n * B())
            table[block_label(INFER, REMOTE, k)] = (partial(self._challenge_remote, k),
                                                    lambda n=nr, r=rows: (2 * n + 3 * r) * B())
            table[block_label(BACKWARD, REMOTE, k)] = (partial(self._sent_part, k),
                                                       lambda n=nr: 2 * n * B())
            table[block_label(BACKWARD, LOCAL, k)] = (partial(self._local_part, k),
                                                      lambda n=nl: 2 * n * B())
            table[block_label(BACKWARD, UPDATE, k)] = (
                partial(self._update, k),
                lambda n=nl + nr, k=k: 2 * n * B() + 2 * self.delta[k].size)
            table[block_label(BACKWARD, DELTA, k)] = (
                partial(self._delta, k),
                lambda s=sent, k=k: s * B() + (1 + act) * self.X[k - 1].size)
        table[block_label(BACKWARD, OUTPUT)] = (self._output,
                                                lambda: (4 + act) * self.X[-1].size)
        return table

    # -- Alg. 2: the blocks of a layer's SpFF -------------------------------------------------------
    def _pack(self, k: int, challenge: bool) -> None:
        """Line 4: update every x̄ with the entries of x^{k-1}_m its receiver uses (on a GPU
        gathered into one device block)."""
        mp, buf = self.maps[k - 1], self._buf
        x_prev = self._x if challenge else self.X[-1]
        if not self.gpu:
            for ix, sbuf in zip(mp.send_index, buf.xsend[k - 1]):
                np.take(x_prev, ix, axis=0, out=sbuf)
            return
        d = self._dev[k - 1]
        if d.send_all.size:
            self.xp.take(x_prev, d.send_all, axis=0, out=buf.xsend[k - 1])
        self._unsent = (0, k)

    def _local(self, k: int) -> None:
        """Line 6: the local product W^k_local x^{k-1} + b^k, while the messages travel."""
        x_prev = self.X[-1]
        if self.gpu:
            d = self._dev[k - 1]
            z = d.Wl @ x_prev
            z += d.b[:, None]
        else:
            z = self.maps[k - 1].W_local @ x_prev
            z += self.b[k - 1][:, None]
        self._z = z

    def _remote(self, k: int) -> None:
        """Lines 9-10: the remote product W^k_remote x̂^{k-1} and the activation: x^k_m."""
        mp, buf, z = self.maps[k - 1], self._buf, self._z
        W = mp.W_remote
        if self.gpu:
            self._arrived(buf.xrecv[k - 1], buf.xrecv_h[k - 1] if self._staged else None)
            W = self._dev[k - 1].Wr
        if mp.recv_ptr[-1]:
            z += W @ buf.xrecv[k - 1]
        self.X.append(self.f.apply(self.xp.ascontiguousarray(z, dtype=self.dtype)))
        self._z = None

    def _challenge_local(self, k: int) -> None:
        """Line 6 with Graph Challenge semantics: the local product alone."""
        mp = self.maps[k - 1]
        if self.gpu:
            self._z = self._dev[k - 1].Wl @ self._x
            return
        z = np.zeros((mp.rows.size, self._B), dtype=self.dtype)
        spmm_add(mp.W_local.indptr, mp.W_local.indices, mp.W_local.data, self._x, z)
        self._z = z

    def _challenge_remote(self, k: int) -> None:
        """Lines 9-10 with Graph Challenge semantics: the remote product, the bias where the
        product is non-zero, the cap (the fused kernel on the CPU)."""
        mp, buf, z = self.maps[k - 1], self._buf, self._z
        bias, ymax = self._challenge
        if self.gpu:
            self._arrived(buf.xrecv[k - 1], buf.xrecv_h[k - 1] if self._staged else None)
            if mp.recv_ptr[-1]:
                z += self._dev[k - 1].Wr @ buf.xrecv[k - 1]
            challenge_finish_device(z, bias, ymax)
        else:
            spmm_add_challenge(mp.W_remote.indptr, mp.W_remote.indices, mp.W_remote.data,
                               buf.xrecv[k - 1], z, bias, ymax)
        self._x, self._z = z, None

    # -- Alg. 3: the blocks of a layer's SpBP -------------------------------------------------------
    def _output(self) -> None:
        """Line 2 (eq. 6): delta^L of the squared error, and this rank's share of the loss (on a
        GPU it stays on the device)."""
        xp, XL, Y = self.xp, self.X[-1], self._Y
        B = XL.shape[1]
        if self.gpu:
            self.loss = 0.5 * xp.sum((XL - Y) ** 2) / B
        else:
            self.loss = float(0.5 * np.sum((XL - Y) ** 2) / B)
        self.delta = [None] * (self.L + 1)
        self.delta[self.L] = xp.ascontiguousarray((XL - Y) / B * self.f.derivative(XL))

    def _sent_part(self, k: int) -> None:
        """Line 4, the part sent: W^k_remote^T delta^k, a block of rows per owner."""
        W = self._dev[k - 1].Wr if self.gpu else self.maps[k - 1].W_remote
        self._s_remote = self.xp.ascontiguousarray(W.T @ self.delta[k])
        self._unsent = (1, k)

    def _local_part(self, k: int) -> None:
        """Line 4, the local part: W^k_local^T delta^k."""
        if self.gpu:
            self._s = self._dev[k - 1].Wl.T @ self.delta[k]
        else:
            self._s = np.asarray(self.maps[k - 1].W_local.T @ self.delta[k])

    def _update(self, k: int) -> None:
        """Lines 8-9: the outer-product update on the sparsity (SDDMM) and the bias, while the
        messages travel."""
        mp, delta, x_prev, lr = self.maps[k - 1], self.delta[k], self.X[k - 1], self.lr
        xrecv = self._buf.xrecv[k - 1]
        if self.gpu:
            d = self._dev[k - 1]
            sddmm_update_device(d.rows_l, d.cols_l, d.Wl.data, delta, x_prev, lr)
            if mp.recv_ptr[-1]:
                sddmm_update_device(d.rows_r, d.cols_r, d.Wr.data, delta, xrecv, lr)
            d.b -= lr * delta.sum(axis=1)
            return
        sddmm_update(mp.W_local.indptr, mp.W_local.indices, mp.W_local.data, delta, x_prev, lr)
        if mp.recv_ptr[-1]:
            sddmm_update(mp.W_remote.indptr, mp.W_remote.indices, mp.W_remote.data, delta,
                         xrecv, lr)
        self.b[k - 1] -= lr * delta.sum(axis=1)

    def _delta(self, k: int) -> None:
        """Lines 10-13: the received partial sums added to the local part, delta^{k-1}."""
        mp, buf, s, x_prev = self.maps[k - 1], self._buf, self._s, self.X[k - 1]
        if self.gpu:
            d = self._dev[k - 1]
            self._arrived(buf.srecv[k - 1], buf.srecv_h[k - 1] if self._staged else None)
            for i, ix in enumerate(d.send_index):   # per source: the CPU's order
                s[ix] += buf.srecv[k - 1][d.send_ptr[i]:d.send_ptr[i + 1]]
        else:
            for ix, rb in zip(mp.send_index, buf.srecv[k - 1]):
                s[ix] += rb
        self.delta[k - 1] = self.xp.ascontiguousarray(s * self.f.derivative(x_prev))
        self._s = self._s_remote = None

    # -- the GPU path ------------------------------------------------------------------------------
    # The same programs as the CPU path (receives, sends and waits where Algs. 2-3 have them), so
    # the plan's records, the ledger and the program are the CPU run's.  A layer's outgoing rows
    # are gathered into one device block; with a host-only MPI that block is copied to pinned
    # memory once (one host wait per layer and direction: the data MPI must read) and the
    # messages are its row ranges; received rows are copied up once per layer, the compute
    # stream waiting for the copy without a host wait.

    def _to_mpi(self, exchange: tuple, dev_block, host_block):
        """The block an exchange's messages leave from, handed to MPI with one host wait at
        its first message (host-only MPI: one copy to pinned memory; CUDA-aware: the device
        memory once its kernels completed)."""
        if self._unsent == exchange:
            self._unsent = None
            if self._staged:
                if dev_block.size:
                    self.backend.to_host(dev_block, host_block,
                                         after=self.xp.cuda.get_current_stream().record())
            elif dev_block.size:
                self.backend.synchronize()
        return host_block if self._staged else dev_block

    def _landing(self, dev_block, host_block):
        """The block a layer's receives land in: the pinned host block (host-only MPI, once
        the copy up of its previous contents has run) or the device block (CUDA-aware: the
        receives are posted after the layer's sends, whose host wait covers the kernels that
        read the block before)."""
        if not self._staged:
            return dev_block
        fence = self._fences.pop(id(host_block), None)
        if fence is not None and not self.backend._fence_done(fence):
            self.backend._fence_wait(fence)
        return host_block

    def _device_input(self, A, rows: int, what: str):
        xp = self.xp
        A = xp.ascontiguousarray(xp.asarray(A, dtype=self.dtype))
        if A.ndim != 2 or A.shape[0] != rows:
            raise ValueError(f"{what} must have shape ({rows}, batch) on rank {self.rank}, "
                             f"got {A.shape}")
        return A

    def _arrived(self, dev_block, host_block) -> None:
        """The received rows on the device (host-only MPI: one copy up, no host wait; the
        copy fences the host block's next receive)."""
        if self._staged and dev_block.size:
            self._fences[id(host_block)] = self.backend.to_device(host_block, dev_block)
