"""H-SADMM (PruneX): hierarchical structured ADMM on leader/follower communicators.

* :mod:`hsadmm.projection` — structured projections onto filter / channel / shape sets (eq. 10);
* :mod:`hsadmm.shrink` — bitwise mask codec for the OR-sync (eq. 14) and the shrink plan,
  :class:`~hsadmm.shrink.ShrinkPlan` (physical shrinkage and recovery, eq. 15, §4.4);
* :mod:`hsadmm.plan` — the records of one iteration (:class:`~hsadmm.plan.HSADMMPlan` from a
  shrink plan, :class:`~hsadmm.plan.FlatADMMPlan`: calls and the solver's compute between them)
  and the iteration's program generated from them (:func:`~hsadmm.plan.iteration_programs`):
  what the solver executes (:class:`substrate.executor.Executor`) and accounts and what
  ``commvol`` prices;
* :mod:`hsadmm.penalty` — residual balancing of layer-wise penalties and their groups (§3.4);
* :mod:`hsadmm.config` — :class:`~hsadmm.config.HSADMMConfig`, the solver's options (and flags);
* :mod:`hsadmm.solver` — Algorithm 1 (:class:`~hsadmm.solver.HSADMM`) and flat consensus ADMM,
  with checkpointable state;
* :mod:`hsadmm.export` — physically compact export of the trained model and its loader;
* :mod:`hsadmm.train` — ``python -m hsadmm train`` (``--checkpoint-every`` / ``--resume``).
"""
