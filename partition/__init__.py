"""partition: the multi-phase fixed-vertex hypergraph model of H-SGD (paper 001, §5).

Public API::

    from partition import (Partition, make_partition, hypergraph_partition, random_partition,
                           HypergraphConfig, build_layer_hypergraph, compress_hypergraph,
                           partition_metrics, PartitionMetrics, build_maps, LayerMaps)

CLI: ``python -m partition radixnet --neurons N --layers L --parts P --method hypergraph|random``.
"""

from partition.hypergraph import (LayerHypergraph, build_layer_hypergraph, compress_hypergraph,
                                  connectivity_cutsize)
from partition.maps import LayerMaps, build_layer_maps, build_maps
from partition.metrics import PartitionMetrics, format_table, pair_volumes, partition_metrics
from partition.partitioners import (PARTITIONERS, HypergraphConfig, Partition,
                                    hypergraph_partition, input_owner_from_connectivity,
                                    make_partition, partition_layer, random_partition)

__all__ = [
    "PARTITIONERS", "HypergraphConfig", "LayerHypergraph", "LayerMaps", "Partition",
    "PartitionMetrics", "build_layer_hypergraph", "build_layer_maps", "build_maps",
    "compress_hypergraph", "connectivity_cutsize", "format_table", "hypergraph_partition",
    "input_owner_from_connectivity", "make_partition", "pair_volumes", "partition_layer",
    "partition_metrics", "random_partition",
]
