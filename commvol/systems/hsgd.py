"""H-SGD / SGD predictions on RadiX-Nets (paper 001) from the run's own plan,
:meth:`sparse_sgd.plan.HSGDPlan.build`, priced from its records (:meth:`HSGDPlan.calls`: the
calls ``sparse_sgd train`` executes and accounts) by the one generic rule
(:meth:`commvol.systems.core.IterCost.from_calls`).

``SystemModel.Options`` is the trainer's :class:`sparse_sgd.plan.HSGDOptions` (``--batch-size``,
``--dtype`` and the partition options); the network (``--neurons``, ``--layers``) and the seed
come with the spec (:class:`commvol.hsgd.RadixNetSpec`).
"""

from __future__ import annotations

from sparse_sgd.plan import HSGDOptions, HSGDPlan
from sparse_sgd.radixnet import radixnet
from substrate.calls import Placement
from substrate.costmodel import CostModel

from ..hsgd import RadixNetSpec
from .core import IterCost, Prediction, SystemModel, _check_topology, register

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
    placement = Placement.node_major(nodes, gpus_per_node)
    p, batch, itemsize = nodes * gpus_per_node, options.batch_size, options.itemsize
    step = plan.calls(placement, batch, itemsize)
    p2p = sum(c.nbytes for c in step if c.algorithm == "p2p")
    it = IterCost.from_calls(step, placement, cost, payload=p2p // max(p, 1))
    setup = IterCost.from_calls(plan.calls(placement, batch, itemsize, interval="setup"),
                                placement, cost)
    t1 = plan.metrics.table1()
    notes = ((f"{method} row partition into p = {p} parts ({plan.partition.seconds:.2f} s); "
              f"Table 1 (SpFF words per processor per layer): avg volume "
              f"{t1['avg_volume']:.1f}, max {t1['max_volume']:.1f}, avg messages "
              f"{t1['avg_messages']:.2f}, imbalance {t1['imbalance']:.3f}"),
             (f"one step = SpFF + SpBP on a batch of {batch} vectors ({itemsize}-byte values) + "
              "loss all-reduce; payload = average bytes a processor sends"),
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
