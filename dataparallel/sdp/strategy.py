"""SDP's strategy (paper 003): runs :class:`~dataparallel.sdp.plan.SDPPlan`'s records from its
step programs (the gated average on the holder sets' sub-communicators, B_b-SDP's parameter
broadcasts after the update, the model's assembly on rank 0 in a step before an evaluation),
binding their buffers and compute items, and reports the mask's statistics."""

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
    #: a holder set whose members are the node leaders is no leaders' phase: the ranks
    #: outside it do not wait for it
    leader_waits = False

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

        # the sub-communicators of the holder sets (the gated average) and of B_b-SDP's
        # broadcast groups, built once (collectively) and handed to the executor
        reduce_sets = plan.reduce_sets
        self._comms: dict = {}
        self._reduce: dict = {}          # j -> (coordinates, buffer, degree) of held sets
        for j, (s, comm) in enumerate(zip(reduce_sets, self._build_comms(
                [plan.members(s) for s in reduce_sets]))):
            if comm is not None:
                idx = plan.indices(s)
                self._comms.setdefault(comm.group, comm)
                self._reduce[j] = (xp.asarray(idx), xp.empty(idx.size, dtype=g.dtype),
                                   int(plan.degrees[s]))
        self.num_reduce_sets = len(reduce_sets)
        self._bcast: dict = {}           # b -> (coordinates, buffer, root) of this rank's groups
        groups = plan.bcast_groups
        for b, ((s, ranks, root), comm) in enumerate(zip(groups, self._build_comms(
                [list(r) for _, r, _ in groups]))):
            if comm is not None:
                idx = plan.indices(s)
                self._comms.setdefault(comm.group, comm)
                self._bcast[b] = (xp.asarray(idx), xp.empty(idx.size, dtype=g.dtype),
                                  ranks.index(root))

        # evaluation: rank 0 lacks the sets it does not hold; each set's lowest rank sends them
        self._send = None
        self._recv: dict = {}            # sender -> (parameter coordinates, BN channels, buffer)
        for r, ss in plan.assemble_sets.items():
            if r not in plan.assemble_counts:
                continue
            pidx = np.flatnonzero(np.isin(plan.set_id, ss))
            bidx = {name: np.flatnonzero(np.isin(ids, ss))
                    for name, ids in sorted(plan.buffer_ids.items())}
            bidx = {k: xp.asarray(v) for k, v in bidx.items() if v.size}
            entry = (xp.asarray(pidx), bidx, xp.zeros(plan.assemble_counts[r], dtype=g.dtype))
            if rank == r:
                self._send = entry
            if rank == 0:
                self._recv[r] = entry
        self._full = xp.empty_like(model.params.flat) if rank == 0 else None
        self._scale = (xp.asarray(plan.scale.astype(g.dtype))
                       if rank == 0 and options.eval_rescale and self.forward_masking else None)

        # this rank's records of a step, and of a step before an evaluation
        self._records = {ev: plan.records(topo.placement, rank, self.itemsize, evaluate=ev)
                         for ev in (False, True)}
        self.flop_factor = plan.flop_factor()

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

    def communicators(self) -> dict:
        """The holder sets' and broadcast groups' sub-communicators this rank is in."""
        return self._comms

    # -- every step ------------------------------------------------------------------------------
    def records(self, state) -> list:
        """This rank's records of the step (:meth:`SDPPlan.records`): the gated average, with
        each held set's packing before its all-reduce (which goes out during the backward once
        the set's span is written, ``--overlap on``) and its unpacking after; B_b-SDP's
        broadcasts after the update; before an evaluation (``state.evaluated``) the
        assembly of the model on rank 0 after the update (its bytes belong to the step)."""
        return self._records[bool(state.evaluated)]

    def compute(self, label: str):
        name, _, at = label.partition("[")
        if name == "sdp_pack":
            return lambda: self._pack(int(at[:-1]))
        if name == "sdp_unpack":
            return lambda: self._unpack(int(at[:-1]))
        if label == "sdp_mask":
            return self._mask_grad
        if label == "sdp_assemble":
            return self._place_assembled
        return super().compute(label)

    def _pack(self, j: int) -> None:
        """The coordinates of the ``j``-th holder set into its buffer."""
        idx, buf, _ = self._reduce[j]
        self.xp.take(self.model.grads.flat, idx, out=buf)

    def _unpack(self, j: int) -> None:
        """Gated average (eq. "average"): ``ĝ_j = Σ_{i ∈ H_j} g_ij / d_j`` on the holders."""
        idx, buf, d = self._reduce[j]
        buf /= d
        self.model.grads.flat[idx] = buf

    def _mask_grad(self) -> None:
        """Zero outside the subnetwork."""
        g = self.model.grads.flat
        g *= self.mask

    def buffer(self, call):
        """A held set's buffer (packed by ``sdp_pack``); a broadcast group's (its root takes the
        set's updated parameters); the message a sender of the assembly sends rank 0 (its sets'
        parameters, then their BatchNorm statistics)."""
        name, _, at = (call.label or "").partition("[")
        if name == GATED:
            return self._reduce[int(at[:-1])][1]
        if name == BCAST:
            idx, buf, root = self._bcast[int(at[:-1])]
            if self.topo.rank == call.group[root]:
                self.xp.take(self.model.params.flat, idx, out=buf)
            return buf
        if call.phase == ASSEMBLE:
            pidx, bidx, buf = self._send
            self.xp.take(self.model.params.flat, pidx, out=buf[:pidx.size])
            off = pidx.size
            for name, idx in bidx.items():
                buf[off:off + idx.size] = self.model.buffers[name][idx]
                off += idx.size
            return buf
        return super().buffer(call)

    def receive_buffer(self, source: int, nbytes: int, tag: int):
        """Rank 0: the message of the assembly's sender ``source``."""
        buf = self._recv[source][2]
        if buf.nbytes != nbytes:
            raise ValueError(f"SDP assembly: rank {source} sends {nbytes} bytes, the plan says "
                             f"{buf.nbytes}")
        return buf

    def received(self, call, result) -> None:
        """B_b-SDP: the broadcast's updated parameters replace the set's (every member)."""
        if call.phase == BCAST:
            idx, buf, _ = self._bcast[int(call.label[len(BCAST) + 1:-1])]
            self.model.params.flat[idx] = buf

    def _place_assembled(self) -> None:
        """Rank 0, after the assembly: the BatchNorm statistics of the channels it does not
        hold are the holders' (its own running statistics of them are never used in training,
        so the holder's replace them for evaluation); the parameters are read by
        :meth:`eval_params`."""
        for pidx, bidx, buf in self._recv.values():
            off = int(pidx.size)
            for name, idx in bidx.items():
                self.model.buffers[name][idx] = buf[off:off + idx.size]
                off += idx.size

    def total_steps(self, base_steps: int) -> int:
        """``floor(f · base_steps)`` SDP iterations with ``--flop-match`` (§4.1.1)."""
        if self.options.flop_match:
            return math.floor(base_steps * self.flop_factor)
        return base_steps

    def eval_params(self):
        """Rank 0: the full model assembled from the holders (its own coordinates plus those
        received at the last evaluation step), weight-scaled only with ``--eval-rescale``."""
        theta = self.model.params.flat
        if not self.forward_masking:
            return theta
        full = self._full
        full[...] = theta
        for pidx, _, buf in self._recv.values():
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
