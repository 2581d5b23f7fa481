"""H-SADMM (PruneX): hierarchical structured ADMM on leader/follower communicators.

Landed so far: structured projections (eq. 10), bitwise mask codec for the OR-sync (eq. 14),
physical shrinkage/recovery plans (eq. 15, §4.4), residual balancing of layer-wise penalties
(§3.4).  The solver loop (Algorithm 1) builds on these and on ``models/``.
"""
