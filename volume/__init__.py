"""volume — closed-form communication volumes of every system, written from the papers.

The bottom layer beside :mod:`substrate`: each module imports only ``numpy`` and
:mod:`substrate.costmodel`'s primitives (ring / binomial / all-gather wire bytes), never a
system package, so the systems (``hsadmm``, ``dataparallel``, ``sparse_sgd``) and ``commvol``
can all import it.

* :mod:`volume.hsadmm` — H-SADMM and flat consensus ADMM per iteration (PruneX eq. 15);
* :mod:`volume.dataparallel` — dense DDP (flat and two-level), Top-K/DGC all-gather;
* :mod:`volume.pactrain` — PacTrain's compact all-reduce and ternary payloads;
* :mod:`volume.sdp` — SDP's gated all-reduce, parameter broadcast and assembly;
* :mod:`volume.ssfusion` — SSFusion's density-aware counts, fused buffers, warm-up traffic.
"""
