"""H-SGD (seed 001): Fig. 4, strong scaling of H-SGD and SGD (time to process one input vector)
on the 120-layer RadiX-Nets, N = 1024 ... 65536, P = 32 ... 512, and the stated numbers of its
breakdown, Fig. 5.

Every (N, P) is one training step on one input vector (Algorithm 1, lines 2-9: SpFF, SpBP and
the update; the trainer's loss all-reduce is left out) of the network the paper names, on
``P / 16`` nodes of the paper's cluster (``hsgd-warwick-nextscale``: one MPI rank a core,
§6.1), partitioned as ``sparse_sgd train`` does: the multi-phase hypergraph model (H-SGD) or
uniformly random rows (SGD).  The step is the job simulation of every rank's program
(:func:`commvol.job.sparse_step`: windows of one and two periods of the network, the second
extended over the 120 layers), each block costed from its FLOPs and compulsory memory traffic
on one core (:func:`sparse_sgd.program.block_work`), each message on the cluster's links.

The paper states no time, only the speedup ranges of H-SGD over SGD per N; the times are
printed with ``paper = None`` (plotted only).  A miss's diagnosis names what the model lacks
and the one input whose change would close it, with the value the paper's number implies.
"""

from __future__ import annotations

import functools
from pathlib import Path

from sparse_sgd.activations import ACT_FLOPS
from sparse_sgd.plan import HSGDOptions
from sparse_sgd.program import GATHER_BYTES, INDEX_BYTES
from substrate.cluster import Cluster
from substrate.jobsim import JobSimOptions

from ..hsgd import RadixNetSpec
from ..job import SPARSE_ACTIVATION, sparse_step
from ..workload import DeviceModel
from . import Figure, Input, Row, _toml

__all__ = ["figures", "inputs", "measure"]

PAPER = "hsgd"
CLUSTER = "hsgd-warwick-nextscale"
#: §6.1: "four different sized sparse DNNs consisting of 120 layers", P = 32 ... 512
NEURONS = (1024, 4096, 16384, 65536)
PROCESSORS = (32, 64, 128, 256, 512)
LAYERS = 120
#: §6.1: "a single core to each MPI process" and 16 cores a node
RANKS_PER_NODE = 16
#: Algorithm 1: one input vector x0 an update
BATCH = 1
#: not stated (C++); the project's default ``--dtype``
DTYPE = "float64"
#: figures(quick=True): the smallest network on two processor counts
QUICK = {"neurons": (1024,), "processors": (32, 64)}
SERIES = {"H-SGD": "hsgd", "SGD": "sgd"}
TOLERANCE = 0.15


# -- the paper's numbers ----------------------------------------------------------------------------
#: the TOML's figure tables, points and inputs of this paper
_figure = functools.partial(_toml.figure, PAPER)
_point = functools.partial(_toml.point, PAPER)
_toml_input = functools.partial(_toml.toml_input, PAPER)


# -- inputs -----------------------------------------------------------------------------------------
def _cluster_inputs(cluster: Cluster) -> list[Input]:
    name = Path(cluster.path).stem if cluster.path else cluster.name
    keys = [("device", "peak_tflops", "TFLOP/s"), ("device", "memory_gbs", "GB/s"),
            ("device", "efficiency", ""), ("device", "launch_us", "us"),
            ("node", "devices", ""), ("node", "fabric", ""), ("node", "fabric_gbps", "Gbit/s"),
            ("node", "fabric_latency_us", "us"), ("node", "nics", ""),
            ("node", "nic_gbps", "Gbit/s"), ("node", "nic_latency_us", "us"),
            ("library", "call_us", "us"), ("library", "transport", "")]
    out = []
    for section, key, unit in keys:
        src = cluster.sources.get(f"{section}.{key}",
                                  "default of substrate.cluster (the file sets none: no "
                                  "published number for this stack)")
        out.append(Input(f"{name}: {section}.{key}", getattr(getattr(cluster, section), key),
                         unit, src))
    return out


def inputs() -> list[Input]:
    """Every input of the figures (the paper's configuration, the project's choices, the
    cluster file's numbers)."""
    f = "fig4"
    jobsim = JobSimOptions()
    return [
        _toml_input(f, "layers"), _toml_input(f, "neurons"), _toml_input(f, "processors"),
        _toml_input(f, "cores_per_node"), _toml_input(f, "ranks_per_core"),
        _toml_input(f, "network_generator"), _toml_input(f, "batch"),
        _toml_input(f, "timed_quantity"), _toml_input(f, "partitioner"),
        Input("hsgd.activation_flops", ACT_FLOPS[SPARSE_ACTIVATION], "FLOP an element",
              "6.1: 'We used sigmoid function as linear activation function'; FLOPs of f and "
              "f' an element: sparse_sgd.activations.ACT_FLOPS (the net's own FLOP counts)"),
        Input("hsgd.dtype", DTYPE, "", "not stated in the paper (C++): 8-byte values, the "
              "project's default --dtype"),
        Input("hsgd.partition_engine", "KaHyPar 'fast', tiled over the network's period",
              "", "the project's partitioner (sparse_sgd.plan.plan_partition, the one "
              "`sparse_sgd train` runs) for the paper's PaToH: the same model (§5) and "
              "epsilon = 0.01; PaToH is not available"),
        Input("hsgd.csr_bytes", f"value + {INDEX_BYTES}-byte index a nonzero, "
              f"{INDEX_BYTES}-byte row pointers, {GATHER_BYTES}-byte gather lists", "",
              "Williams et al., SC'07 (compulsory traffic of a CSR SpMV); SciPy CSR uses "
              "int32 indices at these sizes (sparse_sgd.program.block_work)"),
        Input("hsgd.layer_windows", "1 and 2 periods of the partition, extended to 120 layers",
              "", "commvol.job.sparse_step: a RadiX-Net's first layers and their partition do "
              "not depend on the later ones; measured against every layer simulated within "
              "3.2 % (tests/test_reproduce_hsgd_sdp.py)"),
        Input("jobsim.link_sharing", jobsim.link_sharing, "", "substrate.jobsim default"),
        Input("jobsim.eager_limit", jobsim.eager_limit, "bytes", "substrate.jobsim default "
              "(every message eager)"),
        *_cluster_inputs(Cluster.load(CLUSTER)),
    ]


# -- the runs ---------------------------------------------------------------------------------------
def measure(neurons=NEURONS, processors=PROCESSORS, layers: int = LAYERS) -> dict:
    """``{(N, P): {"hsgd": sparse_step(...), "sgd": ...}}`` on the paper's cluster."""
    cluster = Cluster.load(CLUSTER)
    device = DeviceModel(cluster.device)
    options = HSGDOptions(batch_size=BATCH, dtype=DTYPE)
    jobsim = JobSimOptions(cluster=CLUSTER)
    out = {}
    for N in neurons:
        spec = RadixNetSpec(int(N), int(layers))
        for P in processors:
            if P % RANKS_PER_NODE:
                raise ValueError(f"P = {P}: the paper's nodes hold {RANKS_PER_NODE} ranks")
            out[(N, P)] = {system: sparse_step(system, spec, P // RANKS_PER_NODE,
                                               RANKS_PER_NODE, options, device, cluster,
                                               BATCH, jobsim=jobsim, loss=False)
                           for system in SERIES.values()}
    return out


def _comm(r: dict) -> float:
    """Seconds of a step not spent in the slowest rank's blocks (waiting for messages)."""
    return max(0.0, r["step_s"] - r["compute_s"])


def _speedup(res: dict) -> float:
    return res["sgd"]["step_s"] / res["hsgd"]["step_s"]


def _within(paper, ours) -> bool:
    return paper not in (None, 0) and ours is not None and abs(ours / paper - 1) <= TOLERANCE


def _table1_paper(N: int, P: int, series: str) -> dict | None:
    try:
        return _point("table1", series, "per-processor sends (Table 1 row, actual values)",
                      neurons=N, processors=P)["values"]
    except ValueError:
        return None


def _speedup_diagnosis(N: int, P: int, res: dict, paper: float) -> str:
    """The SGD communication time the paper's speedup implies, beside the paper's own Table 1."""
    h, s = res["hsgd"], res["sgd"]
    ours = _speedup(res)
    want_sgd = paper * h["step_s"]
    comm, want_comm = _comm(s), want_sgd - s["compute_s"]
    pr, ph = _table1_paper(N, P, "SGD (random partitioning)"), _table1_paper(N, P, "H-SGD")
    t_r, t_h = s["table1"], h["table1"]
    ratio = want_comm / comm if comm > 0 else float("nan")
    text = (f"speedup {ours:.2f} vs {paper:g}. Mechanism: the paper's SGD baseline sends far "
            f"less than random rows on this network do (ours are the closed form E[R]: "
            f"{t_r['avg_volume']:.0f} words, {t_r['avg_messages']:.0f} messages a processor a "
            f"layer")
    if pr is not None:
        text += (f"; the paper's Table 1 R row: {pr['avg_volume']} words, {pr['avg_messages']} "
                 f"messages, {pr['avg_volume'] / t_r['avg_volume']:.2f} x our words")
    if ph is not None:
        text += (f"; H rows: ours {t_h['avg_volume']:.0f} words, {t_h['avg_messages']:.1f} "
                 f"messages, the paper's {ph['avg_volume']}, {ph['avg_messages']}")
    text += (f"). Single input: SGD's communication time a step, {1e3 * comm:.3f} ms, would "
             f"have to be {1e3 * want_comm:.3f} ms ({ratio:.2f} x)")
    if want_comm <= 0:
        text += (": impossible (SGD's compute alone is longer than the paper's speedup allows; "
                 "the model lacks SGD's slower local compute, see fig5)")
    elif pr is not None:
        text += (f"; plausible: of the order of the paper's own R/E[R] word ratio "
                 f"{pr['avg_volume'] / t_r['avg_volume']:.2f}")
    return text + "."


def fig4(results: dict) -> Figure:
    """Times and H-SGD / SGD speedups per (N, P), and the stated speedup ranges."""
    rows: list[Row] = []
    neurons = sorted({N for N, _ in results})
    for N in neurons:
        procs = sorted(P for n, P in results if n == N)
        for P in procs:
            res = results[(N, P)]
            for series, system in SERIES.items():
                rows.append(Row(series, f"N={N}, P={P}", "time per input vector", "ms", None,
                                1e3 * res[system]["step_s"],
                                note="plotted only (Fig. 4)"))
            rng = _point("fig4", "H-SGD", "speedup over SGD (time ratio)", neurons=N,
                         processors="32-512")["range"]
            rows.append(Row("H-SGD", f"N={N}, P={P}", "speedup over SGD", "x", None,
                            _speedup(results[(N, P)]),
                            note=f"plotted only; the text's range for N={N}: {rng[0]}-{rng[1]}"))
        rng = _point("fig4", "H-SGD", "speedup over SGD (time ratio)", neurons=N,
                     processors="32-512")["range"]
        sp = {P: _speedup(results[(N, P)]) for P in procs}
        at = f"N={N}, P={procs[0]}-{procs[-1]}"
        for which, paper, P in (("lowest", rng[0], min(sp, key=sp.get)),
                                ("highest", rng[1], max(sp, key=sp.get))):
            ours = sp[P]
            diag = "" if _within(paper, ours) else _speedup_diagnosis(N, P, results[(N, P)],
                                                                       paper)
            rows.append(Row("H-SGD", at, f"speedup over SGD, {which} over P", "x", paper, ours,
                            diagnosis=diag, note=f"ours at P={P}"))
    if (65536, 512) in results:
        pt = _point("fig4", "H-SGD", "speedup over SGD (time ratio)", neurons=65536,
                    processors=512)
        ours = _speedup(results[(65536, 512)])
        rows.append(Row("H-SGD", "N=65536, P=512", "speedup over SGD (best case)", "x",
                        pt["value"], ours,
                        diagnosis="" if _within(pt["value"], ours) else
                        _speedup_diagnosis(65536, 512, results[(65536, 512)], pt["value"]),
                        note="the paper's 'best speedup' (conflicts with its N=65536 range)"))
    fig = _figure("fig4")
    return Figure(PAPER, "fig4", fig["title"], rows, inputs(),
                  note="one input vector a step (Alg. 1), P/16 nodes; times are the job "
                       "simulation's (commvol.job.sparse_step)")


def _compute_diagnosis(lo_hi: tuple, ours: tuple) -> str:
    return (f"local-compute speedup {ours[0]:.2f}-{ours[1]:.2f} vs {lo_hi[0]}-{lo_hi[1]}. "
            "Mechanism: the roofline counts each block's compulsory memory traffic only; the "
            "paper attributes its 1.9-2.7x to load balance and the temporal cache locality of "
            "x^{k-1} the hypergraph rows keep (§6.2), which random rows lose (every nonzero's "
            "x entry a cache miss). Single input: the memory bandwidth SGD's blocks run at "
            f"would have to be {lo_hi[0] / ours[0]:.2f}-{lo_hi[1] / ours[1]:.2f} x lower than "
            "H-SGD's (an effective rate, not the core's); plausible for indirect accesses "
            "that miss the cache.")


def _share_diagnosis(N: int, P: int, r: dict, paper_pct: float, bw: float) -> str:
    """The compute (hence memory bandwidth) the paper's communication share implies."""
    comm, comp = _comm(r), r["compute_s"]
    ours = 100 * comm / r["step_s"]
    want_comp = comm * (100 - paper_pct) / paper_pct
    implied = bw * comp / want_comp if want_comp > 0 else float("nan")
    return (f"communication share {ours:.0f} % vs {paper_pct:g} %. Mechanism: compute is the "
            "memory roofline of one core (compulsory CSR traffic at the socket's bandwidth / "
            "8); the paper's C++ kernels and the cache behaviour they have are not modelled. "
            f"Single input, holding our {1e3 * comm:.3f} ms of communication: the blocks would "
            f"have to take {1e3 * want_comp:.3f} ms (ours {1e3 * comp:.3f}), i.e. "
            f"device.memory_gbs {implied:.3g} GB/s instead of {bw:g}"
            + ("; implausible for a Haswell core (cache-resident blocks run faster, not slower)"
               if implied < bw / 4 or implied > 4 * bw else "; plausible") + ".")


def fig5(results: dict) -> Figure | None:
    """The stated numbers of Fig. 5: communication shares (N = 65536), the share of the
    improvement that is communication (N = 16384, 65536), the local-compute speedup."""
    rows: list[Row] = []
    bw = Cluster.load(CLUSTER).device.memory_gbs
    for series, system in SERIES.items():
        for P in (32, 512):
            if (65536, P) not in results:
                continue
            r = results[(65536, P)][system]
            pt = _point("fig5", series, "communication share of running time",
                        neurons=65536, processors=P)
            ours = 100 * _comm(r) / r["step_s"]
            rows.append(Row(series, f"N=65536, P={P}", "communication share of running time",
                            "%", pt["value"], ours,
                            diagnosis="" if _within(pt["value"], ours) else
                            _share_diagnosis(65536, P, r, pt["value"], bw)))
    for N in (16384, 65536):
        pt = _point("fig5", "H-SGD", "communication improvement / total improvement",
                    neurons=N, processors="32 -> 512")
        for P, paper in ((32, pt["range"][0]), (512, pt["range"][1])):
            if (N, P) not in results:
                continue
            h, s = results[(N, P)]["hsgd"], results[(N, P)]["sgd"]
            ours = 100 * (_comm(s) - _comm(h)) / (s["step_s"] - h["step_s"])
            rows.append(Row("H-SGD", f"N={N}, P={P}",
                            "communication improvement / total improvement", "%", paper, ours,
                            diagnosis="" if _within(paper, ours) else
                            (f"{ours:.0f} % vs {paper:g} %. Mechanism: the model's local "
                             "compute of H-SGD and SGD differs only by the rows' remote "
                             "entries (no cache model: see the local-compute rows), so "
                             "nearly all of the improvement is communication. Single input: "
                             "SGD's compute (its effective memory bandwidth), as in the "
                             "local-compute rows.")))
    if not rows and not results:
        return None
    pt = _point("fig5", "H-SGD", "local computation (SpMV + update) speedup", neurons="all",
                processors="all")
    speed = [res["sgd"]["compute_s"] / res["hsgd"]["compute_s"] for res in results.values()]
    lo, hi = min(speed), max(speed)
    for which, paper, ours in (("lowest", pt["range"][0], lo), ("highest", pt["range"][1], hi)):
        rows.append(Row("H-SGD", "all N, P", f"local computation speedup, {which}", "x", paper,
                        ours, diagnosis="" if _within(paper, ours) else
                        _compute_diagnosis(tuple(pt["range"]), (lo, hi))))
    fig = _figure("fig5")
    return Figure(PAPER, "fig5", fig["title"], rows, inputs(),
                  note="communication = the step less the slowest rank's blocks; the same runs "
                       "as fig4")


def figures(quick: bool = False) -> list[Figure]:
    """Fig. 4 and Fig. 5's stated numbers; ``quick``: N = 1024 on P = 32 and 64 only."""
    if quick:
        results = measure(QUICK["neurons"], QUICK["processors"])
    else:
        results = measure()
    out = [fig4(results)]
    f5 = fig5(results)
    if f5 is not None:
        out.append(f5)
    return out

