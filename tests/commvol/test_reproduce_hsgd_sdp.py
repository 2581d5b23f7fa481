"""H-SGD's job at scale and SDP's per-device memory, against closed forms written here, and the
reproduced figures' paper values against the papers' TOML files.

* H-SGD (paper 001): a one-rank job's step on a compute-bound device is Algorithm 1's FLOPs
  over the rate (counted here line by line); on a memory-bound device every block's CSR
  traffic; the bytes a job moves are the words of eqs. 8-9 counted by brute force from the
  partition, SpFF and SpBP; the windowed step (:func:`commvol.job.sparse_step`) is within a
  few per cent of every layer simulated; a short network's partition is the long one's first
  layers (what the windows rest on); all ranks' programs at once equal the one-rank ones.
* SDP (paper 003): worker memory on a tiny LLaMA-style tree against §3.2's formulas with the
  parameters counted by hand; the transformer activation count; ``--system sdp`` on a
  transformer spec plans over its blocks.
* ``figures(quick=True)`` of both papers run and their paper numbers are the TOML's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from commvol.hsgd import RadixNetSpec
from commvol.job import Job, sparse_network, sparse_step
from commvol.memory import (
    FP32_ADAM,
    SDP_MIXED,
    Precision,
    device_memory,
    sdp_device_memory,
    transformer_activation_bytes,
)
from commvol.workload import DeviceModel
from dataparallel.sdp import plan_masks
from models.modelspec import layer_tree_specs
from models.params import ParamLayout
from models.transformer import llama_layers
from simulation.cluster import Cluster, Device, Node
from sparse_sgd.plan import HSGDOptions
from sparse_sgd.program import step_program, step_programs
from substrate.calls import Placement
from substrate.program import normalize

try:
    import tomllib
except ModuleNotFoundError:        # Python 3.10
    import tomli as tomllib

PAPERS = Path(__file__).resolve().parents[2] / "commvol" / "papers"
SIGMOID = 4                        # FLOPs an element of f or f'
OPTS = HSGDOptions(batch_size=1)


def _cluster(**node):
    return Cluster("test", device=Device(peak_tflops=1.0, memory_gbs=1.0), node=Node(**node))


# -- H-SGD ------------------------------------------------------------------------------------------
def test_one_rank_compute_bound_step_is_algorithm_1s_flops_over_the_rate():
    """P = 1: nothing is sent; on a device whose memory is never the bound the step is the
    FLOPs of Alg. 1 for one vector: per layer z = W x + b (2 nnz + N) and f (4N); delta^L
    ((4 + 4) N: the error and f'); per layer the outer-product update (2 nnz) and the bias
    (2N); for k >= 2 only (Alg. 3: s^1 would only give delta^0) s = W^T delta (2 nnz) and
    delta^{k-1} = s * f'(z^{k-1}) ((1 + 4) N)."""
    spec = RadixNetSpec(64, 6)
    W = sparse_network("hsgd", spec, 1, 1, OPTS).weights
    N = [w.shape[0] for w in W]
    flops = sum(2 * w.nnz + n + SIGMOID * n for w, n in zip(W, N))
    flops += (4 + SIGMOID) * N[-1]
    flops += sum(2 * w.nnz + 2 * n for w, n in zip(W, N))
    flops += sum(2 * w.nnz + (1 + SIGMOID) * w.shape[1] for w in W[1:])
    rate = 1e9                                                      # FLOP/s
    dev = DeviceModel(Device(peak_tflops=rate / 1e12, memory_gbs=1e12))
    r = Job("hsgd", spec, 1, 1, OPTS, None, dev, 1, loss=False).run(_cluster())
    assert r["step_s"] == pytest.approx(flops / rate, rel=1e-12)
    assert r["bytes"] == {"intra": 0.0, "inter": 0.0}


def test_one_rank_memory_bound_step_is_the_csr_traffic():
    """P = 1, memory-bound: per layer the forward reads W (8 + 4 bytes a nonzero, 4 a row
    pointer), x^{k-1}, the bias and writes z, then reads and writes z and writes x^k; SpBP reads
    W^T for s (and delta^k, writes s), reads and writes every value in the update (reading
    delta^k and x^{k-1}, and the bias twice); delta^{k-1} reads s, x^{k-1} and writes delta^{k-1};
    delta^L reads x^L, y and writes it (bytes of 8-byte values, one vector)."""
    spec = RadixNetSpec(64, 6)
    W = sparse_network("hsgd", spec, 1, 1, OPTS).weights
    v = 8
    total = 3 * W[-1].shape[0] * v
    for k, w in enumerate(W, start=1):
        n, rows, cols = w.nnz, w.shape[0], w.shape[1]
        ptr = 4 * (rows + 1)
        total += (12 * n + ptr + cols * v + rows * v + rows * v)      # W_local x + b
        total += (ptr + 3 * rows * v)                               # (no remote) + f
        total += (20 * n + 2 * ptr + rows * v + cols * v + 2 * rows * v)   # update, bias
        if k >= 2:                                                  # no s^1, no delta^0
            total += (ptr + rows * v)                               # spbp remote: none
            total += (12 * n + ptr + rows * v + cols * v)           # W^T delta
            total += 3 * cols * v                                   # delta^{k-1}
    bw = 1e9
    dev = DeviceModel(Device(peak_tflops=1e6, memory_gbs=bw / 1e9))
    r = Job("hsgd", spec, 1, 1, OPTS, None, dev, 1, loss=False).run(_cluster())
    assert r["step_s"] == pytest.approx(total / bw, rel=1e-12)


def _words(W, owners) -> int:
    """SpFF words of a layer, brute force from eqs. 8-9: every processor m receives x(j) once
    for each column j its rows use whose owner is another processor."""
    A = sp.coo_matrix(W)
    need = {(int(owners[1][i]), int(j)) for i, j in zip(A.row, A.col)}
    return sum(1 for m, j in need if owners[0][j] != m)


@pytest.mark.parametrize("system", ["hsgd", "sgd"])
def test_the_bytes_a_job_moves_are_the_words_of_eqs_8_and_9(system):
    """2 x 4 ranks, batch 3 of float64: every SpFF word and every SpBP partial sum (layers
    k >= 2) moves once, 3 x 8 bytes."""
    spec = RadixNetSpec(64, 5)
    opts = HSGDOptions(batch_size=3)
    net = sparse_network(system, spec, 2, 4, opts)
    o = net.partition.owners
    ff = [_words(w, (o[k], o[k + 1])) for k, w in enumerate(net.weights)]
    want = 3 * 8 * (sum(ff) + sum(ff[1:]))
    r = Job(system, spec, 2, 4, opts, None, DeviceModel(Device()), 3, steps=1,
            loss=False).run(_cluster(devices=4, fabric="shm"))
    assert r["bytes"]["intra"] + r["bytes"]["inter"] == pytest.approx(want)
    assert r["bytes"]["inter"] > 0


def test_a_short_networks_partition_is_the_long_ones_first_layers():
    """The windows of :func:`sparse_step` rest on this: the RadiX-Net of 2p + 1 layers and its
    tiled hypergraph partition are the first layers of the 16-layer network's."""
    long_, short = RadixNetSpec(256, 16), RadixNetSpec(256, 9)       # period p = 4
    a = sparse_network("hsgd", long_, 1, 4, OPTS)
    b = sparse_network("hsgd", short, 1, 4, OPTS)
    assert a.period == b.period == 4
    for k in range(9):
        np.testing.assert_array_equal(a.partition.owners[k], b.partition.owners[k])
    for k in range(8):
        assert (a.weights[k] != b.weights[k]).nnz == 0


@pytest.mark.parametrize("system,N,L,P", [("hsgd", 256, 24, 8), ("sgd", 256, 12, 8),
                                          ("hsgd", 1024, 30, 32)])
def test_windows_extended_match_every_layer_simulated(system, N, L, P):
    """Two windows (one and two periods) extended over L layers against the whole network's
    job simulation on the paper's cluster."""
    cl = Cluster.load("hsgd-warwick-nextscale")
    dev = DeviceModel(cl.device)
    spec = RadixNetSpec(N, L)
    M, R = max(1, P // 16), min(P, 16)
    w = sparse_step(system, spec, M, R, OPTS, dev, cl, 1, loss=False)
    x = sparse_step(system, spec, M, R, OPTS, dev, cl, 1, loss=False, exact=True)
    assert len(w["windows"]) == 2 and len(x["windows"]) == 1
    assert w["step_s"] == pytest.approx(x["step_s"], rel=0.04)
    assert w["compute_s"] == pytest.approx(x["compute_s"], rel=0.04)
    assert x["compute_s"] <= x["step_s"] <= x["bound_s"] * (1 + 1e-9)


def test_all_ranks_programs_at_once_are_the_one_rank_programs():
    net = sparse_network("sgd", RadixNetSpec(64, 4), 2, 3, OPTS)
    pl = Placement.node_major(2, 3)
    records = net.plan.tagged_calls(pl, 2, 8)
    for loss in (True, False):
        every = step_programs(records, 4, pl, loss=loss)
        for r in range(pl.size):
            one = step_program(records, 4, pl, r, loss=loss)
            assert normalize(every[r]) == normalize(one)
        kinds = {e[0] for e in every[0]}
        has_collective = any(e[0] == "C" and e[4] for p in every for e in p)
        assert has_collective == loss and "S" in kinds


def test_a_job_names_a_bad_window_and_batch():
    spec = RadixNetSpec(64, 4)
    with pytest.raises(ValueError, match="use 1 <= window <= 4"):
        Job("hsgd", spec, 1, 2, OPTS, None, DeviceModel(Device()), 1, window=5)
    with pytest.raises(ValueError, match="batch of >= 1 input vectors"):
        Job("sgd", spec, 1, 2, OPTS, None, DeviceModel(Device()), 0.5)


# -- SDP ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Shape:
    name: str
    root: object
    layout: ParamLayout
    buffers: dict


def _tiny_llama(depth=4, dim=8, vocab=16, hidden=12):
    root = llama_layers(4, vocab, dim=dim, depth=depth, heads=2, hidden=hidden)
    return _Shape("tiny-llama", root, ParamLayout(layer_tree_specs(root)), {})


@pytest.mark.parametrize("mode", ["block", "block-backward"])
@pytest.mark.parametrize("b", [1, 2, 3])
def test_sdp_worker_memory_is_section_3_2_on_hand_counted_parameters(mode, b):
    """Per block: two RMSNorm weights (2 d), q, k, v, o without bias (4 d^2), SwiGLU's three
    matrices (3 d h); outside: the token table and the untied head (2 V d) and the final norm
    (d).  Forward masking: 14 bytes a held coordinate; backward masking: 2 bytes every
    coordinate + 12 a held one (bf16 weights, fp32 gradients, fp32 Adam moments)."""
    d, h, V, depth, n = 8, 12, 16, 4, 4
    block = 2 * d + 4 * d * d + 3 * d * h
    outside = 2 * V * d + d
    total = outside + depth * block
    model = _tiny_llama(depth, d, V, h)
    assert model.layout.total == total
    from fractions import Fraction
    plan = plan_masks(model, mode, n, coverage=Fraction(1), active_blocks=(b, depth))
    for r in range(n):
        held = outside + b * block
        assert plan.held(r) == held
        mem = sdp_device_memory(plan, r)
        want = 14 * held if mode == "block" else 2 * total + 12 * held
        assert mem.states == want and mem.activations == 0
    ddp = device_memory(total, SDP_MIXED)
    assert ddp.states == 14 * total


def test_block_masks_do_not_depend_on_the_masking_direction():
    """What :func:`commvol.reproduce.sdp.plans` rests on: B_b-SDP's plan is B-SDP's with its
    mode set."""
    from fractions import Fraction
    model = _tiny_llama()
    a, b = (plan_masks(model, m, 4, coverage=Fraction(1), active_blocks=(2, 4), seed=3)
            for m in ("block", "block-backward"))
    np.testing.assert_array_equal(a.set_id, b.set_id)
    assert a.sets == b.sets and a.detail == b.detail
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


def test_device_memory_splits_weights_gradients_optimizer_and_activations():
    m = device_memory(1000, Precision(weights=2, gradients=4, optimizer=8, activations=2),
                      materialized=600, trained=250, batch=3, activation_elements=10)
    assert (m.weights, m.gradients, m.optimizer, m.activations) == (1200, 1000, 2000, 60)
    assert m.total == 4260
    assert device_memory(10, FP32_ADAM).states == 160
    with pytest.raises(ValueError, match="trained"):
        device_memory(10, materialized=4, trained=5)


def test_transformer_activations_are_korthikantis_count():
    """GPT-3-style layer: s = 2048, h = 768, a = 12: s h (34 + 5 a s / h) bytes."""
    want = 2048 * 768 * 34 + 5 * 12 * 2048 * 2048
    assert transformer_activation_bytes(2048, 768, 12, 1) == want
    assert transformer_activation_bytes(2048, 768, 12, 12) == 12 * want


@pytest.mark.parametrize("model,blocks", [("swin-t", 12), ("llama-134m", 12)])
def test_sdp_plans_over_a_transformer_specs_blocks(model, blocks):
    """``--system sdp`` on the paper-scale transformer specs (once refused: no trainable model
    of that name) masks their residual blocks: d = 12 (Swin-T's 2 + 2 + 6 + 2, LLaMA's 12)."""
    if model == "llama-134m":
        pytest.importorskip("numpy")
    from commvol.systems.sdp import sdp_plan
    from dataparallel.sdp import SDPOptions
    from models.specs import get_spec
    spec = get_spec(model)
    plan = sdp_plan(spec, 1, 8 if model == "swin-t" else 7,
                    SDPOptions(sdp_mode="block", active_blocks=f"8/{blocks}"))
    assert plan.detail["d"] == blocks and plan.total == spec.num_params


# -- the figures --------------------------------------------------------------------------------------
def _toml(paper):
    return tomllib.loads((PAPERS / f"{paper}.toml").read_text())


def _fig(doc, fid):
    return next(f for f in doc["figure"] if f["id"] == fid)


def test_hsgd_quick_figures_quote_the_toml():
    from commvol.reproduce import hsgd
    doc = _toml("hsgd")
    figs = {f.id: f for f in hsgd.figures(quick=True)}
    f4 = figs["fig4"]
    rng = next(p for p in _fig(doc, "fig4")["points"]
               if p["at"] == {"neurons": 1024, "processors": "32-512"})["range"]
    stated = [r for r in f4.rows if r.paper is not None and r.ours is not None]
    assert sorted(r.paper for r in stated) == sorted(rng)
    every = [r for r in f4.rows if r.quantity == "time per input vector"]
    assert len(every) == 2 * len(hsgd.CELLS)                       # every cell has its rows
    times = [r for r in every if r.ours is not None]
    assert len(times) == 4 and all(r.paper is None and r.ours > 0 for r in times)
    for r in f4.rows + figs["fig5"].rows:                         # the others say so
        if r.ours is None:
            assert "not simulated" in r.note and r.status == "-", r
    for r in f4.rows:
        if r.quantity == "speedup over SGD" and r.ours is not None:
            h = next(t for t in times if t.series == "H-SGD" and t.at == r.at)
            s = next(t for t in times if t.series == "SGD" and t.at == r.at)
            assert r.ours == pytest.approx(s.ours / h.ours)
        if r.paper is not None and r.ratio is not None and abs(r.ratio - 1) > 0.15:
            assert "Single input" in r.diagnosis
    comp = next(p for p in _fig(doc, "fig5")["points"]
                if p["quantity"] == "local computation (SpMV + update) speedup")["range"]
    assert sorted(r.paper for r in figs["fig5"].rows
                  if r.paper is not None and r.ours is not None) == sorted(comp)
    assert {i.name for i in f4.inputs} >= {"hsgd.layers", "hsgd.batch",
                                           "hsgd-warwick-nextscale: node.nic_gbps"}
    assert all(i.source for i in f4.inputs)


def test_sdp_quick_figures_quote_the_toml():
    from commvol.reproduce import sdp
    doc = _toml("sdp")
    figs = {f.id: f for f in sdp.figures(quick=True)}
    want = {(p["series"], p["at"]["active_blocks"]): p["value"]
            for p in _fig(doc, "table4")["points"] if p["quantity"] == "Rel-Mem"}
    for r in figs["table4"].rows:
        assert r.paper == want[(r.series, r.at.split("=")[1])]
        if abs(r.ratio - 1) > 0.15:
            assert "Single input" in r.diagnosis
    comm = figs["comm_per_device"].rows
    assert comm[0].paper == 2.0                                    # "2N"
    for r in comm[1:]:
        b = int(r.at.split("=")[-1].split("/")[0])
        assert r.paper == pytest.approx(2 * b / 12)                 # "2CN" at C = A
    assert all(i.source for i in figs["table4"].inputs)
