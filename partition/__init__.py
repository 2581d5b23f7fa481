"""partition: the multi-phase fixed-vertex hypergraph model of H-SGD (paper 001, §5).

Public API::

    from partition import (Partition, make_partition, hypergraph_partition, random_partition,
                           HypergraphConfig, build_layer_hypergraph, compress_hypergraph,
                           partition_metrics, PartitionMetrics, build_maps, LayerMaps,
                           place_inputs)

CLI: ``python -m partition layers W1.npz ... WL.npz --parts P --method hypergraph|random|both``
(RadiX-Nets: ``python -m sparse_sgd partition``).  Imports only ``substrate`` (never
``sparse_sgd``).
"""

from partition.hypergraph import (
                                  LayerHypergraph,
                                  build_layer_hypergraph,
                                  compress_hypergraph,
                                  connectivity_cutsize,
)
from partition.maps import LayerMaps, build_layer_maps, build_maps
from partition.metrics import (
                                  PartitionMetrics,
                                  expected_random_spff,
                                  format_table,
                                  pair_volumes,
                                  partition_metrics,
)
from partition.partitioners import (
                                  ENGINES,
                                  PARTITIONERS,
                                  PHASES,
                                  PRESETS,
                                  HypergraphConfig,
                                  Partition,
                                  hypergraph_partition,
                                  input_owner_from_connectivity,
                                  layer_period,
                                  make_partition,
                                  partition_layer,
                                  partitioner_errors,
                                  random_partition,
)
from partition.placement import INPUT_PLACEMENTS, place_inputs

__all__ = [
    "ENGINES", "INPUT_PLACEMENTS", "PARTITIONERS", "PHASES", "PRESETS", "HypergraphConfig",
    "LayerHypergraph", "LayerMaps",
    "Partition",
    "PartitionMetrics", "build_layer_hypergraph", "build_layer_maps", "build_maps",
    "compress_hypergraph", "connectivity_cutsize", "expected_random_spff", "format_table",
    "hypergraph_partition", "input_owner_from_connectivity", "layer_period", "make_partition",
    "pair_volumes", "partition_layer", "partition_metrics", "partitioner_errors",
    "place_inputs", "random_partition",
]
