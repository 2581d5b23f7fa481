"""H-SGD / SGD predictions on RadiX-Nets (paper 001) from the run's own plan,
:meth:`sparse_sgd.plan.HSGDPlan.build`.

``SystemModel.Options`` is the trainer's :class:`sparse_sgd.plan.HSGDOptions` (``--batch-size``,
``--dtype`` and the partition options); the network (``--neurons``, ``--layers``) and the seed
come with the spec (:class:`commvol.hsgd.RadixNetSpec`).
"""

from __future__ import annotations

from sparse_sgd.plan import NUM_CLASSES, PHASE_LOSS, PHASE_PARTITION, HSGDOptions, HSGDPlan
from sparse_sgd.radixnet import radixnet
from substrate import costmodel as cm
from substrate.costmodel import CostModel

from ..hsgd import RadixNetSpec, p2p_rank_seconds
from .core import CallCost, Prediction, SystemModel, _check_topology, register

__all__ = ["predict_hsgd", "predict_partitioned", "predict_sgd"]


def predict_partitioned(spec: RadixNetSpec, nodes: int, gpus_per_node: int,
                        options: HSGDOptions, cost: CostModel | None, method: str):
    """Prediction of one sparse-SGD step under the ``method`` plan of ``spec`` (the plan
    ``sparse_sgd train`` builds for ``nodes x gpus_per_node`` ranks and ``spec.seed``)."""
    cost = cost or CostModel()
    network = spec.config()
    weights = radixnet(network)
    plan = HSGDPlan.build(weights, nodes, gpus_per_node, method, options, seed=spec.seed,
                          network=network)
    p, batch, itemsize = nodes * gpus_per_node, options.batch_size, options.itemsize
    ph = plan.step_phases(batch, itemsize)
    secs = p2p_rank_seconds(plan.metrics, plan.node_of, batch=batch, word_bytes=itemsize,
                            cost=cost)
    calls = CallCost(nodes, gpus_per_node, cost)
    calls.add("spff", ph["spff"]["messages"], secs["spff"])
    calls.add("spbp", ph["spbp"]["messages"], secs["spbp"])
    calls.allreduce(PHASE_LOSS, 8 * (1 + NUM_CLASSES * batch), "world")
    phases = {k: {cm.INTRA: v["intra_bytes"], cm.INTER: v["inter_bytes"]} for k, v in ph.items()
              if v["bytes"]}
    p2p = sum(ph[k]["bytes"] for k in ("spff", "spbp"))
    it = calls.finish(phases, payload=p2p // max(p, 1))
    b = plan.setup_phase(weights)
    setup_calls = CallCost(nodes, gpus_per_node, cost)
    setup_calls.bcast(PHASE_PARTITION, b["bytes"], "world")
    setup = setup_calls.finish({PHASE_PARTITION: {cm.INTRA: b["intra_bytes"],
                                                  cm.INTER: b["inter_bytes"]}})
    t1 = plan.metrics.table1()
    notes = (f"{method} row partition into p = {p} parts ({plan.partition.seconds:.2f} s); "
             f"Table 1 (SpFF words per processor per layer): avg volume {t1['avg_volume']:.1f}, "
             f"max {t1['max_volume']:.1f}, avg messages {t1['avg_messages']:.2f}, imbalance "
             f"{t1['imbalance']:.3f}",
             f"one step = SpFF + SpBP on a batch of {batch} vectors ({itemsize}-byte values) + "
             "loss all-reduce; payload = average bytes a processor sends",
             "setup: partition broadcast from rank 0 (counted once in totals)")
    nnz = int(sum(W.nnz for W in weights))
    return Prediction("hsgd" if method == "hypergraph" else "sgd", spec.name, nodes,
                      gpus_per_node, "iteration", ((None, it),), setup=setup, notes=notes,
                      num_params=nnz)


def predict_hsgd(spec, nodes, gpus_per_node, options: HSGDOptions, cost=None) -> Prediction:
    """H-SGD: SpFF/SpBP under the multi-phase hypergraph partition."""
    _check_topology(nodes, gpus_per_node)
    return predict_partitioned(spec, nodes, gpus_per_node, options, cost, "hypergraph")


def predict_sgd(spec, nodes, gpus_per_node, options: HSGDOptions, cost=None) -> Prediction:
    """SGD: SpFF/SpBP under the uniformly random row partition."""
    _check_topology(nodes, gpus_per_node)
    return predict_partitioned(spec, nodes, gpus_per_node, options, cost, "random")


register(SystemModel("hsgd", predict_hsgd, HSGDOptions, spec_kind="radixnet", loop="hsgd",
                     description="H-SGD: SpFF/SpBP, hypergraph row partition", baseline="sgd"))
register(SystemModel("sgd", predict_sgd, HSGDOptions, spec_kind="radixnet", loop="hsgd",
                     description="SGD: SpFF/SpBP, random row partition", baseline=None))
