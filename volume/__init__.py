"""volume — closed-form communication volumes of every system, written from the papers.

The bottom layer beside :mod:`substrate`: each module imports only ``numpy`` and
:mod:`volume.collectives` (the wire bytes of a ring all-reduce, an all-gather and a binomial
broadcast, written from the algorithms, independently of :mod:`substrate.schedule`), never a
system package.  Only the tests import it: it is the second source the plans' records and the
schedules' messages are held against.

* :mod:`volume.collectives` — the collectives' wire bytes per link class;

* :mod:`volume.hsadmm` — H-SADMM and flat consensus ADMM per iteration (PruneX eq. 15);
* :mod:`volume.dataparallel` — dense DDP (flat and two-level), Top-K/DGC all-gather;
* :mod:`volume.pactrain` — PacTrain's compact all-reduce and ternary payloads;
* :mod:`volume.sdp` — SDP's gated all-reduce, parameter broadcast and assembly;
* :mod:`volume.ssfusion` — SSFusion's density-aware counts, fused buffers, warm-up traffic.
"""
