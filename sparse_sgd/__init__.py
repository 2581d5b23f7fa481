"""sparse_sgd: RadiX-Net / Graph Challenge networks and distributed SpFF/SpBP SGD (paper 001).

Public API::

    from sparse_sgd import (RadixNetConfig, radixnet, graph_challenge_network, ChallengeNetwork,
                            DistributedSparseNet, SerialSparseNet, challenge_inference_serial,
                            digits_dataset, mnist_dataset, class_targets, HSGDPlan,
                            plan_partition)
    from sparse_sgd import io   # Graph Challenge TSV / category files

CLI: ``python -m sparse_sgd {train,infer,partition,generate}``.
"""

from sparse_sgd.data import class_targets, digits_dataset, mnist_dataset, train_test_split
from sparse_sgd.distributed import DistributedSparseNet
from sparse_sgd.plan import HSGDOptions, HSGDPlan, PartitionOptions, plan_partition
from sparse_sgd.radixnet import (
                                 CHALLENGE_BIAS,
                                 CHALLENGE_YMAX,
                                 ChallengeNetwork,
                                 RadixNetConfig,
                                 challenge_config,
                                 graph_challenge_network,
                                 mixed_radix_layer,
                                 radixnet,
                                 relabel_owners,
                                 relabelling,
                                 spff_lower_bound,
)
from sparse_sgd.serial import SerialSparseNet, challenge_inference_serial, mse_loss

__all__ = [
    "CHALLENGE_BIAS", "CHALLENGE_YMAX", "ChallengeNetwork", "DistributedSparseNet",
    "HSGDOptions", "HSGDPlan", "PartitionOptions", "RadixNetConfig", "SerialSparseNet",
    "challenge_config", "challenge_inference_serial", "class_targets", "digits_dataset",
    "graph_challenge_network", "mixed_radix_layer", "mnist_dataset", "mse_loss",
    "plan_partition", "radixnet", "relabel_owners", "relabelling", "spff_lower_bound",
    "train_test_split",
]
