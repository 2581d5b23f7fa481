"""SDP's strategy (paper 003): executes :class:`~dataparallel.sdp.plan.SDPPlan`'s records
(the gated average on the holder sets' sub-communicators, B_b-SDP's parameter broadcasts, the
model's assembly on rank 0 at evaluations) and reports the mask's statistics."""

from __future__ import annotations

import math

import numpy as np

from models import MaskHook
from substrate.calls import Call, price

from ..strategy import Strategy, register
from .analysis import spectral_gap, worker_memory
from .masks import _bits
from .options import SDPOptions
from .plan import ASSEMBLE, BCAST, GATED, SDPPlan

__all__ = ["SDP"]


@register
class SDP(Strategy):
    """Subnetwork data parallelism: fixed masks, gated average among each coordinate's holders.

    See :mod:`dataparallel.sdp` for the masks, the communication and the reported quantities.
    """

    name = "sdp"
    Options = SDPOptions

    def __init__(self, ctx, options: SDPOptions) -> None:
        super().__init__(ctx, options)
        xp, topo = self.xp, self.topo
        rank = topo.rank
        model, opt = ctx.model, ctx.opt
        self.model, self.opt = model, opt
        rpn = topo.require_uniform("SDP", "its holder sets are laid out node by node, "
                                   "ranks_per_node ranks each")
        self.plan = plan = SDPPlan.for_model(model, topo.num_nodes, rpn,
                                             options, seed=ctx.seed)
        self.forward_masking = options.sdp_mode != "block-backward"
        g = model.grads.flat
        self.itemsize = g.dtype.itemsize

        # this rank's row of m: forward masking zeroes the parameters outside the subnetwork;
        # every mode masks the update and freezes the momentum outside (backward masking)
        self.mask = xp.asarray(plan.mask(rank).astype(g.dtype))
        if self.forward_masking:
            model.params.flat[...] *= self.mask
        self.hook = MaskHook(self.mask)
        opt.add_hook(self.hook)

        # gated average: one all-reduce per holder set of the plan, on its own sub-communicator
        reduce_sets = plan.reduce_sets
        self._reduce = []
        for s, comm in zip(reduce_sets, self._build_comms([plan.members(s)
                                                           for s in reduce_sets])):
            if comm is not None:
                idx = plan.indices(s)
                self._reduce.append((xp.asarray(idx), xp.empty(idx.size, dtype=g.dtype), comm,
                                     int(plan.degrees[s]), plan.spans[s]))
        self.num_reduce_sets = len(reduce_sets)

        # B_b-SDP: the lowest holder broadcasts updated parameters to the non-holders
        self._bcast = []
        groups = plan.bcast_groups
        for (s, ranks, root), comm in zip(groups, self._build_comms([list(r) for _, r, _ in
                                                                     groups])):
            if comm is not None:
                idx = plan.indices(s)
                self._bcast.append((xp.asarray(idx), xp.empty(idx.size, dtype=g.dtype), comm,
                                    ranks.index(root)))

        # evaluation: rank 0 lacks the sets it does not hold; each set's lowest rank sends them
        self._send = None
        self._recv: list = []
        for r, ss in plan.assemble_sets.items():
            if r not in plan.assemble_counts:
                continue
            pidx = np.flatnonzero(np.isin(plan.set_id, ss))
            bidx = {name: np.flatnonzero(np.isin(ids, ss))
                    for name, ids in sorted(plan.buffer_ids.items())}
            bidx = {k: xp.asarray(v) for k, v in bidx.items() if v.size}
            entry = (r, xp.asarray(pidx), bidx,
                     xp.zeros(plan.assemble_counts[r], dtype=g.dtype))
            if rank == r:
                self._send = entry
            if rank == 0:
                self._recv.append(entry)
        self._needs_assembly = bool(plan.assemble_counts)
        self._full = xp.empty_like(model.params.flat) if rank == 0 else None
        self._scale = (xp.asarray(plan.scale.astype(g.dtype))
                       if rank == 0 and options.eval_rescale and self.forward_masking else None)

        # the step in flight: the flat end of every tensor (the backward writes them in flat
        # order), the sets sent, their handles, the last call on the stream
        self._end_of = {n: int(model.layout.offsets[n] + model.layout.sizes[n])
                        for n in model.layout.names}
        self._written = self._sent = 0
        self._issued: list = []
        self._prev = None

        self.flop_factor = plan.flop_factor()
        # what ran since the last sync (step_calls): B_b's refresh, the evaluation's assembly
        self._refreshed = self._assembled = False

    # -- planning helpers ------------------------------------------------------------------------
    def _build_comms(self, member_lists: list[list[int]]) -> list:
        """One sub-communicator per member list (``None`` where this rank is not a member).

        ``Comm.sub`` is collective over the world, so pairwise-disjoint lists share one split
        (greedy rounds, the same on every rank); the full list reuses the world communicator.
        Members are ordered by world rank.
        """
        world, rank, n = self.topo.world, self.topo.rank, self.topo.size
        out: list = [None] * len(member_lists)
        rounds: list[list] = []  # [indices, union bitmask]
        for i, ms in enumerate(member_lists):
            if len(ms) == n:
                out[i] = world
                continue
            bits = _bits(ms)
            for rd in rounds:
                if not rd[1] & bits:
                    rd[0].append(i)
                    rd[1] |= bits
                    break
            else:
                rounds.append([[i], bits])
        for idxs, _ in rounds:
            color = next((i for i in idxs if rank in member_lists[i]), -1)
            comm = world.sub(color)
            if color >= 0:
                out[color] = comm
        return out

    # -- every step ------------------------------------------------------------------------------
    def on_ready(self, name: str) -> None:
        """The backward wrote ``name``'s gradient (between units; gradients are written in
        flat order): send every holder set of this rank whose span is now written, in the
        plan's order, on the communication stream; :meth:`sync` waits and unpacks.
        ``--overlap off``: nothing here, every call blocks in :meth:`sync`."""
        if not self.run.recorder.overlap:
            return
        self._written = self._end_of[name]
        while self._sent < len(self._reduce) and self._reduce[self._sent][4][1] <= self._written:
            self._send_set(self._sent)
            self._sent += 1

    def _send_set(self, i: int) -> None:
        """Pack holder set ``i``'s coordinates and issue its SUM all-reduce over its holders
        after its span's gradients and this rank's previous call."""
        xp, clock = self.xp, self.run.clock
        idx, buf, comm, _, (lo, hi) = self._reduce[i]
        with clock.compute(f"sdp_pack[{i}]"):
            xp.take(self.model.grads.flat, idx, out=buf)
        pack = clock.last_event if clock.timeline is not None else None
        self._prev = comm.allreduce(buf, "sum", phase=GATED,
                                    after=[clock.ready(lo, hi), pack, self._prev], wait=False)
        self._issued.append(self._prev)

    def sync(self, state, buffers):
        """Gated average (eq. "average"): ``ĝ_j = Σ_{i ∈ H_j} g_ij / d_j`` on the holders,
        zero elsewhere.  The sets the backward did not send (all with ``--overlap off``) are
        sent here; then every call is waited for in order and unpacked."""
        g, clock = buffers.flat, self.run.clock
        self._refreshed = self._assembled = False
        for i in range(self._sent, len(self._reduce)):
            self._send_set(i)
        for i, (h, (idx, buf, _, d, _)) in enumerate(zip(self._issued, self._reduce)):
            h.wait()
            with clock.compute(f"sdp_unpack[{i}]", deps=h):
                buf /= d
                g[idx] = buf
        with clock.compute("sdp_mask"):
            g *= self.mask
        self._issued, self._prev, self._sent, self._written = [], None, 0, 0
        return g

    def _refresh_params(self) -> None:
        """B_b-SDP: broadcast the updated parameters of every set to its non-holders."""
        xp, theta = self.xp, self.model.params.flat
        for idx, buf, comm, root in self._bcast:
            if comm.rank == root:
                xp.take(theta, idx, out=buf)
            comm.bcast(buf, root, phase=BCAST)
            theta[idx] = buf
        self._refreshed = True

    def _assemble(self) -> None:
        """Send what rank 0 lacks (parameters and BatchNorm statistics) from each set's lowest
        holder to rank 0 (evaluation steps only)."""
        world, xp = self.topo.world, self.xp
        if self._send is not None:
            _, pidx, bidx, buf = self._send
            theta = self.model.params.flat
            xp.take(theta, pidx, out=buf[:pidx.size])
            off = pidx.size
            for name, idx in bidx.items():
                buf[off:off + idx.size] = self.model.buffers[name][idx]
                off += idx.size
            world.waitall([world.isend(buf, 0, tag=7, phase=ASSEMBLE)])
        if self._recv:
            world.waitall([world.irecv(buf, r, tag=7, phase=ASSEMBLE)
                           for r, _, _, buf in self._recv])
            for _, pidx, bidx, buf in self._recv:
                off = int(pidx.size)
                for name, idx in bidx.items():
                    # rank 0 does not hold these channels: its own running statistics of them
                    # are never used in training, so the holder's replace them for evaluation
                    self.model.buffers[name][idx] = buf[off:off + idx.size]
                    off += idx.size
        self._assembled = True

    def total_steps(self, base_steps: int) -> int:
        """``floor(f · base_steps)`` SDP iterations with ``--flop-match`` (§4.1.1)."""
        if self.options.flop_match:
            return math.floor(base_steps * self.flop_factor)
        return base_steps

    def before_eval(self) -> None:
        if self._needs_assembly:
            self._assemble()

    def after_step(self, state) -> None:
        if not self.forward_masking:
            self._refresh_params()

    def step_calls(self) -> list[Call]:
        """The plan's records of the last step as it ran: the gated average, the parameter
        broadcasts when :meth:`after_step` refreshed, the assembly when :meth:`before_eval`
        assembled.  Side-effect free (issue 23): the record of what ran is reset by the next
        :meth:`sync`, never by asking."""
        return self.plan.calls(self.topo.placement, self.itemsize, refresh=self._refreshed,
                               assemble=self._assembled)

    def eval_params(self):
        """Rank 0: the full model assembled from the holders (its own coordinates plus those
        received at the last evaluation step), weight-scaled only with ``--eval-rescale``."""
        theta = self.model.params.flat
        if not self.forward_masking:
            return theta
        full = self._full
        full[...] = theta
        for _, pidx, _, buf in self._recv:
            full[pidx] = buf[:pidx.size]
        if self._scale is not None:
            full *= self._scale
        return full

    # -- report ----------------------------------------------------------------------------------
    def report(self) -> dict:
        """Mask statistics, spectral gap ρ (eq. 1, numerical and closed form), wire bytes of one
        step (gated average + B_b-SDP's broadcasts) and their ratio to DDP's world ring
        all-reduce (``payload_ratio``), the FLOP-matching factor, and :func:`worker_memory`.

        ``coverage`` is the realized ``Σ_j d_j / (n T)`` (``degree_histogram`` gives every
        degree); the nominal ``p/n`` is ``coverage_nominal`` (``active_blocks`` ``b/d`` in the
        block modes).

        ρ is computed by :func:`spectral_gap` from the ``n × T`` matrix ``m`` of this run over
        every flat coordinate (those held by all included, ``d_j = n``), i.e. the aggregation
        mask ``m_bwd`` (which equals ``m_fwd`` in the forward-masking modes), evaluated on its
        distinct columns.
        """
        plan, n, where, w = self.plan, self.plan.n, self.topo.placement, self.itemsize
        used = plan.counts > 0
        dmin = int(plan.degrees[used].min())
        step = price(plan.calls(where, w), where).phases
        gated, bcast = (sum(step.get(ph, {}).values()) for ph in (GATED, BCAST))
        ddp = price([Call("ddp", "allreduce", where.world, w * plan.total, w)], where)
        ddp_total = ddp.intra + ddp.inter
        nominal = ("coverage_nominal" if plan.mode == "neuron" else "active_blocks")
        out = {"sdp_mode": plan.mode, "coverage": str(plan.coverage_realized),
               "coverage_realized": float(plan.coverage_realized), nominal: str(plan.coverage),
               "degree_histogram": {str(d): c for d, c in plan.degree_histogram().items()},
               **{k: v for k, v in plan.detail.items() if k != "order"},
               "holder_sets": int(used.sum()), "reduce_sets": self.num_reduce_sets,
               "degree_min": dmin, "degree_max": int(plan.degrees[used].max()),
               "spectral_gap": spectral_gap(plan.distinct_mask()),
               "spectral_gap_closed_form": math.sqrt(max(0.0, 1 / dmin - 1 / n)),
               "gated_bytes_per_sync": gated, "bcast_bytes_per_sync": bcast,
               "payload_ratio": (gated + bcast) / ddp_total if ddp_total else 0.0,
               "flop_factor": float(self.flop_factor),
               "flop_factor_exact": str(self.flop_factor), "flop_match": self.options.flop_match,
               "eval_rescale": bool(self.options.eval_rescale and self.forward_masking)}
        out.update(worker_memory(plan, self.itemsize, self.opt.momentum_buffer is not None))
        return out
