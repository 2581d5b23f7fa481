"""H-SGD / SGD communication predicted from the run's own plan (H-SGD paper, §4-§5, Table 1).

Nothing is re-derived here: the partition and the per-pair word counts ``D^k[m, n]`` come from
:class:`sparse_sgd.plan.HSGDPlan` (:func:`sparse_sgd.plan.plan_partition`, the function
``sparse_sgd train`` runs on rank 0), and the records of SpFF/SpBP, the loss all-reduce and the
partition broadcast from the plan's :meth:`~HSGDPlan.calls`, priced by the generic rule of
:mod:`substrate.calls` (:mod:`commvol.systems.hsgd`).  This module holds the network plumbing of
``python -m commvol predict --system hsgd|sgd`` and ``partition-table``.  The plan's records are
tested against a brute-force count written from eqs. 8-9 (``tests/sparse_sgd/test_plan.py``), the
run's calls against the plan's records, message by message (``tests/sparse_sgd/test_under_mpi.py``).

One **step** is one SpFF + SpBP pass on a mini-batch of ``batch_size`` input vectors (each word of
Table 1 is ``batch_size * itemsize`` bytes) followed by the loss/score all-reduce of
``1 + 10 batch_size`` float64.  Networks are RadiX-Nets of :mod:`sparse_sgd.radixnet`: the Graph
Challenge family for N in {1024, 4096, 16384, 65536}, the same construction (radix-2 layers,
16 x 16 dense Kronecker blocks, weight 1/16) for any other ``N = 16 * 2^m`` (small test sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_sgd.radixnet import (
    CHALLENGE_BIAS,
    CHALLENGE_BLOCK,
    RadixNetConfig,
    challenge_config,
    radixnet,
)

__all__ = [
    "PAPER_LAYERS",
    "RadixNetSpec",
    "radixnet_config",
    "radixnet_weights",
]

#: layers of the paper's networks (§6.1: "four different sized sparse DNNs consisting of 120
#: layers")
PAPER_LAYERS = 120


def radixnet_config(neurons: int, layers: int, *, permute: bool = True,
                    seed: int = 0) -> RadixNetConfig:
    """The RadiX-Net with ``neurons`` per layer (see module docstring).

    Raises
    ------
    ValueError
        Unless ``neurons = 16 * 2^m`` (m >= 1) and ``layers >= 1``.
    """
    neurons, layers = int(neurons), int(layers)
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    if neurons in CHALLENGE_BIAS:
        return challenge_config(neurons, layers, permute=permute, seed=seed)
    n = neurons // CHALLENGE_BLOCK
    if neurons % CHALLENGE_BLOCK or n < 2 or n & (n - 1):
        raise ValueError(f"--neurons must be 16 * 2^m (e.g. 64, 1024, 4096), got {neurons}; the "
                         f"Graph Challenge sizes are {sorted(CHALLENGE_BIAS)}")
    m = n.bit_length() - 1
    return RadixNetConfig(radices=(2,) * m, num_layers=layers, blocks=(CHALLENGE_BLOCK,),
                          weight=1.0 / CHALLENGE_BLOCK, permute=permute, seed=seed)


def radixnet_weights(neurons: int, layers: int, *, permute: bool = True, seed: int = 0) -> list:
    """Weights ``W^1..W^L`` of :func:`radixnet_config`."""
    return radixnet(radixnet_config(neurons, layers, permute=permute, seed=seed))


@dataclass(frozen=True)
class RadixNetSpec:
    """Shape-only description of a RadiX-Net (the "model" of the sparse-DNN systems)."""

    neurons: int = 1024
    layers: int = 12
    permute: bool = True
    seed: int = 0

    @property
    def name(self) -> str:
        return f"radixnet-{self.neurons}x{self.layers}"

    def config(self) -> RadixNetConfig:
        return radixnet_config(self.neurons, self.layers, permute=self.permute, seed=self.seed)

    def weights(self) -> list:
        return radixnet(self.config())
