"""The wire lab: run a spardist job across emulated hosts and count the bytes on the links.

A harness on the top floor beside ``bench/``: it runs other packages' commands (any spardist
command that takes ``--out``) under MPI on emulated hosts and reads their results; no package
imports it.  Root only.

    python -m lab --hosts H --ranks-per-host R [--link MBIT,LATENCY_US] [--out DIR]
        [--launch mpiexec|run_mpi] -- MODULE ARGS...

runs ``python -m mpi4py -m MODULE ARGS --out DIR`` on ``H x R`` ranks spread over ``H``
emulated hosts on this machine, reads how many bytes each host really sent to the other hosts
from the interface counters, subtracts a start-up baseline (an empty MPI run of the same
shape), and writes ``DIR/wire.json`` next to the run's ``summary.json``: booked (the ledger's
``traffic.measured.inter_node_bytes``), predicted, real bytes and the ratios.

One idea per module:

* :mod:`lab.netns`: preflight (root, tools, namespaces, hydra), the state of running labs and
  the removal of labs left behind by killed processes, signal handling;
* :mod:`lab.network`: the emulated hosts and their links (:class:`~lab.network.Network`:
  namespaces, veth pairs, bridge, offload, ``tc`` shaping, counters, header calibration) and
  the ``--link`` parameters (:func:`~lab.network.parse_link`);
* :mod:`lab.programs`: the MPI programs run on the hosts (``--idle`` baseline, ``--sendrecv``
  calibration, ``--pingpong`` alpha);
* :mod:`lab.jobs`: :class:`~lab.jobs.Lab`, MPI jobs across the hosts and the ``wire.json`` of
  each;
* :mod:`lab.analysis`: measured against booked and predicted (bytes per host, time per step,
  the cost model of a lab run, the tables);
* :mod:`lab.experiments`: :func:`~lab.experiments.run_lab` (one measurement) and
  :func:`~lab.experiments.compare_systems` (time per step of several systems on shaped links);
* :mod:`lab.cli`: ``python -m lab``.

Method and every measurement: ``docs/wirelab_notes.md``.
"""

from .analysis import (
    STEPS_JSON,
    WIRE_JSON,
    compare_steps,
    cost_flags,
    format_comparison,
    format_steps,
    format_table,
    link_payload_gbps,
    per_step_from_pair,
    tcp_ack_overhead,
)
from .cli import main
from .experiments import compare_systems, run_lab
from .jobs import DEFAULT_TIMEOUT, YIELD_ENV, Lab
from .netns import (
    NETNS_ETC,
    PREFIX,
    STATE_DIR,
    LabError,
    LabInterrupted,
    check_prerequisites,
    check_root,
    cleanup_stale,
    find_hydra,
    lab_namespaces,
    stale_labs,
)
from .network import TCP_CONGESTION, Network, check_link, parse_link
from .programs import PINGPONG_JSON

__all__ = [
    "DEFAULT_TIMEOUT",
    "NETNS_ETC",
    "PINGPONG_JSON",
    "PREFIX",
    "STATE_DIR",
    "STEPS_JSON",
    "TCP_CONGESTION",
    "WIRE_JSON",
    "YIELD_ENV",
    "Lab",
    "LabError",
    "LabInterrupted",
    "Network",
    "check_link",
    "check_prerequisites",
    "check_root",
    "cleanup_stale",
    "compare_steps",
    "compare_systems",
    "cost_flags",
    "find_hydra",
    "format_comparison",
    "format_steps",
    "format_table",
    "lab_namespaces",
    "link_payload_gbps",
    "main",
    "parse_link",
    "per_step_from_pair",
    "run_lab",
    "stale_labs",
    "tcp_ack_overhead",
]
